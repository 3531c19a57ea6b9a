"""The model an engine serves: the checkpoint loaded (engine/model_loader.py), then its matmuls'
mode checked against fp32, or chosen by `auto` (engine/quantization_check.py). Above the loader,
so loading stays only loading. One LoadedModel can serve several engines (benchmarks comparing
configurations load it once)."""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.cpu_load import OtherLoad
from engine.model_loader import load_checkpoint
from engine.models.linear import weight_bytes_per_token
from engine.quality import Quality
from engine.quantization_check import check_quantization, contended_decisions

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


def load_model(config: ModelConfig, kv_cache_dtype: str = "auto", retime_contended: bool = False) -> LoadedModel:
    """`kv_cache_dtype`: the engine's CacheConfig.kv_cache_dtype, which a quantized mode's start-up
    check scores through (and `auto` chooses with the mode). `retime_contended`: `auto` times
    again a decision it took on a busy machine."""
    checkpoint = load_checkpoint(config)
    checked = check_quantization(checkpoint, config, kv_cache_dtype, retime_contended)
    weight_bytes = weight_bytes_per_token(checked.model)
    logger.info("model loaded: %s, quantization %s, %s KV cache, %.0f MB of matmul weights per decode step%s",
                config.resolved_dtype, checked.mode, str(checked.kv_cache_dtype).removeprefix("torch."),
                weight_bytes / 1e6, f", {checked.quality}" if checked.quality else "")
    return LoadedModel(checked.model, checkpoint.tokenizer, checkpoint.eos_token_ids, checkpoint.max_model_len,
                       checked.mode, weight_bytes, getattr(torch, config.resolved_dtype), checked.quality,
                       checked.kv_cache_dtype)


def wait_for_a_quiet_machine(wait_s: float, span_s: float = 5.0) -> bool:
    """Whether, within `wait_s`, a span of `span_s` came in which other processes left this
    process's threads their cores (engine/cpu_load.py)."""
    deadline = time.monotonic() + wait_s
    while True:
        with OtherLoad() as load:
            time.sleep(span_s)
        if not load.contends_with(torch.get_num_threads()):
            return True
        if time.monotonic() >= deadline:
            return False


def main(argv: list[str] | None = None) -> None:
    """`make install`: the embedded model converted, and its default mode chosen, once. With
    `--retime` (`make serve` runs it in the background, niced): a decision timed while other
    processes took the cores is timed again once the machine is quiet; nothing to do otherwise."""
    parser = argparse.ArgumentParser(prog="python -m engine.model_setup")
    parser.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    parser.add_argument("--retime", action="store_true", help="time again a decision timed on a busy machine")
    parser.add_argument("--wait", type=float, default=1800, help="seconds --retime waits for a quiet machine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ModelConfig(model=args.model)
    if args.retime:
        if not contended_decisions():
            return
        if not wait_for_a_quiet_machine(args.wait):
            logger.info("the machine stayed busy for %.0f s: the decisions stay as timed", args.wait)
            return
    loaded = load_model(config, retime_contended=args.retime)
    print(f"{config.model or 'embedded model'}: quantization {loaded.quantization}, "
          f"{loaded.kv_cache_dtype} KV cache, {loaded.quality}")


if __name__ == "__main__":
    main()
