"""A quantized mode's quality against the fp32 model it comes from, on demand: `cbserve check`
(`check` here). A start never scores nor times anything (engine/model_setup.py picks the mode by
rule); this scores the mode the engine would run, teacher-forced on the shipped English text
(engine/quality.py), through the KV cache it would keep, and caches the figures per model file,
mode, cache dtype and code (engine/cache_dir.py). An engine loading that model reads them back, so
they reach its metrics as the mode's quality. The fp32 reference is scored first and dropped
before the quantized model loads: never two models in memory at once. A mode below the bar is
logged loudly, with the mode to run instead.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.model_loader import default_model_path, load_checkpoint
from engine.quality import KV_CHUNK, TEXT_PATH, WINDOW, Quality, compare, eval_tokens, token_scores

logger = logging.getLogger(__name__)

# the code whose arithmetic the figures measure: a change to any of these scores again
_SCORED_CODE = ("models/linear.py", "models/gguf_types.py", "models/gguf_blocks.py", "models/decoder.py",
                "models/families.py", "models/mlp.py", "models/rope.py", "models/windows.py",
                "models/transformers_backend.py", "csrc/block_quant_linear.cpp", "csrc/gguf_rows.cpp",
                "csrc/block_quant_gemm.cpp", "csrc/vector_gemm.cpp", "csrc/decode_stack.cpp",
                "csrc/paged_decode.cpp", "csrc/rope_kv.cpp", "quality.py")
# what to run instead of a mode whose figures fail the bar
FALLBACK = {"gguf": "int8", "int8": "none", "w4a16": "int8", "w8a16": "int8"}


def figures_path(config: ModelConfig, mode: str, kv_cache_dtype: torch.dtype) -> Path:
    """Where a mode's figures for the model, text length and cache are kept."""
    path = config.model or default_model_path()
    key = "|".join([_identity(path), mode, str(kv_cache_dtype), str(config.quality_check_tokens),
                    str(config.max_model_len), torch.__version__, *(_code_digest(f) for f in _SCORED_CODE)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir("quality") / f"{Path(path).name}-{mode}-{digest}.json"


def cached_quality(config: ModelConfig, mode: str, kv_cache_dtype: torch.dtype) -> Quality | None:
    """The figures `check` measured for this mode of the model, if it ran."""
    path = figures_path(config, mode, kv_cache_dtype)
    return Quality(**json.loads(path.read_text())) if path.is_file() else None


def check(config: ModelConfig, mode: str, kv_cache_dtype: torch.dtype) -> Quality:
    """Scores `mode` of the model through a `kv_cache_dtype` cache against fp32, caches and logs the figures."""
    if mode == "none":
        raise ValueError("quantization 'none' is the fp32 reference itself: nothing to check")
    reference = load_checkpoint(dataclasses.replace(config, quantization="none"), "none")
    tokens = eval_tokens(reference.tokenizer, config.quality_check_tokens)
    window = min(WINDOW, reference.max_model_len)
    reference_scores = token_scores(reference.model, tokens, window)
    del reference
    gc.collect()  # the reference's weights go before the quantized model's come
    model = load_checkpoint(config, mode).model
    chunk = None if kv_cache_dtype == torch.float32 else KV_CHUNK  # an fp32 cache holds the same values
    quality = compare(reference_scores, token_scores(model, tokens, window, kv_cache_dtype=kv_cache_dtype,
                                                     chunk=chunk), window)
    path = figures_path(config, mode, kv_cache_dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(asdict(quality)))
    partial.replace(path)
    if quality.passes:
        logger.info("quantization %s: %s on %d tokens of %s", mode, quality, len(tokens), TEXT_PATH.name)
    else:
        logger.error("QUALITY CHECK FAILED: quantization %s is below the bar (%s): %s on %d tokens of %s; run "
                     "quantization %r instead", mode, Quality.BAR, quality, len(tokens), TEXT_PATH.name,
                     FALLBACK[mode])
    return quality


def _identity(path: str) -> str:
    """A checkpoint file or directory by its path, sizes and modification times."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _code_digest(relative: str) -> str:
    return hashlib.sha256((Path(__file__).parent / relative).read_bytes()).hexdigest()
