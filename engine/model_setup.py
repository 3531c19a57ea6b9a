"""The model an engine serves: the checkpoint loaded (engine/model_loader.py), then its matmuls'
mode checked against fp32, or chosen by `auto` (engine/quantization_check.py). Above the loader,
so loading stays only loading. One LoadedModel can serve several engines (benchmarks comparing
configurations load it once)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.model_loader import load_checkpoint
from engine.models.linear import weight_bytes_per_token
from engine.quality import Quality
from engine.quantization_check import check_quantization

logger = logging.getLogger(__name__)


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
    checkpoint = load_checkpoint(config)
    checked = check_quantization(checkpoint, config, kv_cache_dtype)
    weight_bytes = weight_bytes_per_token(checked.model)
    logger.info("model loaded: %s, quantization %s, %s KV cache, %.0f MB of matmul weights per decode step%s",
                config.resolved_dtype, checked.mode, str(checked.kv_cache_dtype).removeprefix("torch."),
                weight_bytes / 1e6, f", {checked.quality}" if checked.quality else "")
    return LoadedModel(checked.model, checkpoint.tokenizer, checkpoint.eos_token_ids, checkpoint.max_model_len,
                       checked.mode, weight_bytes, getattr(torch, config.resolved_dtype), checked.quality,
                       checked.kv_cache_dtype)


if __name__ == "__main__":  # `make install`: the embedded model converted, and its default mode chosen, once
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(ModelConfig())
    print(f"embedded model: quantization {loaded.quantization}, {loaded.kv_cache_dtype} KV cache, {loaded.quality}")
