"""The model an engine serves: its matmuls' mode picked by rule (`auto`), the checkpoint loaded in
it (engine/model_loader.py), and the quality figures `cbserve check` left for that mode, if any
(engine/quantization_check.py). A start never times the machine nor scores a mode: what it runs
follows from the checkpoint and the CPU alone, so it starts in the time its file takes to read,
however busy the machine. One LoadedModel can serve several engines (benchmarks comparing
configurations load it once).

`auto`'s rule, on the CPU with fp32 activations: a .gguf file runs its own blocks (`gguf`: what
its author chose, the fewest bytes a decode step reads; its kernels are held to the gguf package's
dequantization by the tests); a Hugging Face checkpoint stored in 16 bits (as they are published)
runs `int8` (GGUF Q8_0 blocks: a quarter of fp32's bytes a decode step, top-1 agreement with fp32
above the bar on every family measured, BENCHMARKS.md) where the C++ kernels load, else fp32; one
stored in fp32 runs fp32, its own precision. On CUDA, or with 16-bit activations, `none`.
The KV cache under `auto` is fp16 beside the quantized mode `auto` picks (half the bytes decode
attention reads), else the model's dtype."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig

from engine.attention.selector import resolve_kv_cache_dtype
from engine.config import ModelConfig
from engine.model_loader import default_model_path, load_checkpoint
from engine.models.linear import weight_bytes_per_token
from engine.models.paged_model import PagedModel
from engine.quality import Quality
from engine.quantization_check import cached_quality

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: PagedModel  # on its device, weights read-only
    tokenizer: Any  # transformers tokenizer with the chat template
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest context its RoPE tables cover
    quantization: str  # engine.models.linear mode of its matmuls (`auto` resolved)
    weight_bytes_per_token: int  # matmul weight bytes one decode step reads
    dtype: torch.dtype  # of its weights and activations
    quality: Quality | None  # the mode's figures against fp32, where `cbserve check` measured them
    kv_cache_dtype: torch.dtype  # the KV cache `auto` resolves to (and the figures were scored through)


def resolve_mode(config: ModelConfig) -> str:
    """config.quantization, `auto` resolved by the rule above."""
    if config.quantization != "auto":
        return config.quantization
    if config.device != "cpu" or config.resolved_dtype != "float32":
        return "none"
    path = config.model or default_model_path()
    if path.endswith(".gguf"):
        return "gguf"
    if str(getattr(AutoConfig.from_pretrained(path), "dtype", None)).removeprefix("torch.") == "float32":
        return "none"  # the checkpoint's own precision, exactly
    from engine.cpu_kernels import load_cpu_kernels

    return "int8" if load_cpu_kernels() is not None else "none"


def kv_cache_dtype_of(name: str, mode: str, config: ModelConfig) -> torch.dtype:
    """CacheConfig.kv_cache_dtype for a model in `mode`, `auto` resolved by the rule above."""
    if name == "auto" and config.quantization == "auto" and mode != "none":
        name = "float16"
    return resolve_kv_cache_dtype(name, getattr(torch, config.resolved_dtype), torch.device(config.device))


def load_model(config: ModelConfig, kv_cache_dtype: str = "auto") -> LoadedModel:
    """`kv_cache_dtype`: the engine's CacheConfig.kv_cache_dtype (`auto` resolved here)."""
    started = time.perf_counter()
    mode = resolve_mode(config)
    checkpoint = load_checkpoint(config, mode)
    kv_dtype = kv_cache_dtype_of(kv_cache_dtype, mode, config)
    quality = cached_quality(config, mode, kv_dtype) if mode != "none" else None
    weight_bytes = weight_bytes_per_token(checkpoint.model)
    logger.info("model ready in %.1f s: %s, quantization %s, %s KV cache, %.0f MB of matmul weights per decode "
                "step, quality %s", time.perf_counter() - started, config.resolved_dtype, mode,
                str(kv_dtype).removeprefix("torch."), weight_bytes / 1e6,
                quality if quality is not None else "not checked (`cbserve check` measures it)")
    return LoadedModel(checkpoint.model, checkpoint.tokenizer, checkpoint.eos_token_ids, checkpoint.max_model_len,
                       mode, weight_bytes, getattr(torch, config.resolved_dtype), quality, kv_dtype)
