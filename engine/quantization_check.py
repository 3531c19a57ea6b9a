"""A quantized mode's start-up check against fp32, and `auto`'s choice among the modes.

When a quantized mode loads, it is scored against the fp32 model it came from on the shipped
English text (engine/quality.py): the figures are logged, travel with the loaded model to the
serve app's metrics, and are cached per model file, mode and code (engine/cache_dir.py), so later
starts read them instead of scoring again. `auto` times every mode the checkpoint can run against
fp32 on a one-token forward (a decode step alone) and a 64-token one (a full batch's matmul
shapes), and keeps the fastest on the mean of the two time ratios among those that pass the
quality bar; fp32 always qualifies. On CUDA, `auto` is fp32: the quantized kernels are CPU code.
With a KV cache of another dtype (an fp16 cache for fp32 weights), the modes are scored through it:
the text in chunks that read the earlier tokens back from the cache, as the engine runs them.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.models.linear import quantize
from engine.quality import (
    KV_CHUNK,
    TEXT_PATH,
    WINDOW,
    Quality,
    TokenScores,
    WindowRunner,
    compare,
    eval_tokens,
    token_scores,
)

logger = logging.getLogger(__name__)

AUTO_CANDIDATES = ("gguf", "int8", "w4a16", "w8a16")
PROBE_TOKENS = (1, 64)
PROBE_REPEATS = 7
# the code whose arithmetic the figures measure: a change to any of these scores again
_SCORED_CODE = ("models/linear.py", "models/llama.py", "csrc/block_quant_linear.cpp", "csrc/block_quant_gemm.cpp",
                "csrc/paged_decode.cpp", "csrc/rope_kv.cpp", "quality.py")


@dataclass(frozen=True)
class Checked:
    model: nn.Module
    mode: str  # the mode it runs (`auto` resolved)
    quality: Quality | None  # against fp32; None for fp32 itself, or when the check is off


def check_quantization(fp32_model: nn.Module, config: ModelConfig, model_path: str, tokenizer,
                       stored_blocks, max_model_len: int, kv_cache_dtype: torch.dtype = torch.float32) -> Checked:
    """`fp32_model` quantized as `config.quantization` says, with its figures. `stored_blocks`:
    a callable giving a GGUF's blocks (engine/models/gguf_blocks.py), or None for other files.
    `max_model_len`: the positions the model's RoPE tables cover (windows stay within them).
    `kv_cache_dtype`: the cache the engine keeps, which the modes are scored through.
    The fp32 model is quantized in place unless `auto` needs it to compare against."""
    mode = config.quantization
    if mode == "none" or (mode == "auto" and config.device != "cpu"):
        return Checked(fp32_model, "none", None)
    scorer = _Scorer(fp32_model, tokenizer, config.quality_check_tokens, model_path, min(WINDOW, max_model_len),
                     kv_cache_dtype)
    if mode != "auto":
        if config.quality_check_tokens:
            scorer.reference_if_uncached(mode)
        model = quantize(fp32_model, mode, stored_blocks() if mode == "gguf" else None)
        quality = scorer.quality(model, mode) if config.quality_check_tokens else None
        if quality is not None:
            log = logger.info if quality.passes else logger.warning
            log("quantization %s: %s on %d tokens of %s%s", mode, quality, config.quality_check_tokens,
                TEXT_PATH.name, "" if quality.passes else f": below the bar ({Quality.BAR})")
        return Checked(model, mode, quality)
    return _choose(fp32_model, scorer, stored_blocks)


def _choose(fp32_model: nn.Module, scorer: _Scorer, stored_blocks) -> Checked:
    """Times every candidate, then scores them fastest first: the first that passes wins, and
    slower ones are never scored (scoring costs ~10-60 s a mode, timing ~1 s). Candidates are
    built one at a time, so memory holds at most two copies of the weights."""
    def build(mode: str) -> nn.Module:
        return quantize(copy.deepcopy(fp32_model), mode, stored_blocks() if mode == "gguf" else None)

    probes = [scorer.tokens[:min(n, scorer.window)] for n in PROBE_TOKENS]
    timed = []
    for mode in AUTO_CANDIDATES:
        if mode == "gguf" and stored_blocks is None:
            continue
        try:
            model = build(mode)
        except ValueError as e:  # e.g. a GGUF whose block types the kernel does not read
            logger.info("quantization auto: %s does not apply: %s", mode, e)
            continue
        ratios = _time_ratios(model, fp32_model, probes)
        logger.info("quantization auto: %s step time vs fp32 %s", mode,
                    " / ".join(f"{r:.2f}x at {n} tokens" for r, n in zip(ratios, map(len, probes))))
        timed.append((statistics.fmean(ratios), mode))
    for ratio, mode in sorted(timed):
        if ratio >= 1:
            break
        model = build(mode)
        quality = scorer.quality(model, mode)
        logger.info("quantization auto: %s %s, %s", mode, "passes" if quality.passes else "fails the bar", quality)
        if quality.passes:
            logger.info("quantization auto chose %s (mean step time %.2fx fp32's)", mode, ratio)
            return Checked(model, mode, quality)
    logger.info("quantization auto chose none: no faster mode passes")
    return Checked(fp32_model, "none", None)


def _time_ratios(model: nn.Module, fp32_model: nn.Module, probes: list[list[int]]) -> list[float]:
    """For each probe (a forward of its tokens), the median over PROBE_REPEATS of the model's time
    over fp32's, the two timed alternately so that the machine's drift hits both alike."""
    window = max(len(p) for p in probes)
    runs = (WindowRunner(model, window), WindowRunner(fp32_model, window))
    out = []
    for probe in probes:
        for run in runs:
            run(probe)  # warm-up
        ratios = []
        for _ in range(PROBE_REPEATS):
            seconds = []
            for run in runs:
                start = time.perf_counter()
                run(probe)
                seconds.append(time.perf_counter() - start)
            ratios.append(seconds[0] / seconds[1])
        out.append(statistics.median(ratios))
    return out


class _Scorer:
    """Scores models against the fp32 one, scored at most once; figures cached on disk."""

    def __init__(self, fp32_model: nn.Module, tokenizer, num_tokens: int, model_path: str, window: int,
                 kv_cache_dtype: torch.dtype):
        self.fp32_model, self.model_path, self.window = fp32_model, model_path, window
        self.kv_cache_dtype = kv_cache_dtype
        self.tokens = eval_tokens(tokenizer, num_tokens) if num_tokens else []
        self._reference: TokenScores | None = None
        # what the figures depend on besides the mode: the checkpoint, the text, the cache, torch and our code
        self._key = "|".join([_identity(model_path), str(num_tokens), str(window), str(kv_cache_dtype),
                              torch.__version__, *(_code_digest(f) for f in _SCORED_CODE)])

    def reference_if_uncached(self, mode: str) -> None:
        """Scores the fp32 model now if `mode`'s figures are not cached (before the fp32 model is
        quantized in place)."""
        if not self._path(mode).is_file():
            self._reference_scores()

    def quality(self, model: nn.Module, mode: str) -> Quality:
        path = self._path(mode)
        if path.is_file():
            return Quality(**json.loads(path.read_text()))
        chunk = None if self.kv_cache_dtype == torch.float32 else KV_CHUNK  # an fp32 cache holds the same values
        scores = token_scores(model, self.tokens, self.window, kv_cache_dtype=self.kv_cache_dtype, chunk=chunk)
        quality = compare(self._reference_scores(), scores, self.window)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_text(json.dumps(asdict(quality)))
        partial.replace(path)
        return quality

    def _reference_scores(self) -> TokenScores:
        if self._reference is None:
            self._reference = token_scores(self.fp32_model, self.tokens, self.window)
        return self._reference

    def _path(self, mode: str) -> Path:
        key = hashlib.sha256(f"{mode}|{self._key}".encode())
        return cache_dir("quality") / f"{Path(self.model_path).name}-{mode}-{key.hexdigest()[:16]}.json"


def _identity(path: str) -> str:
    """A checkpoint file or directory by its path, sizes and modification times."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _code_digest(relative: str) -> str:
    return hashlib.sha256((Path(__file__).parent / relative).read_bytes()).hexdigest()
