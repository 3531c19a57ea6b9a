"""A quantized mode's start-up check against fp32, and `auto`'s choice among the modes.

When a quantized mode loads, it is scored against the fp32 model it came from on the shipped
English text (engine/quality.py): the figures are logged, travel with the loaded model to the
serve app's metrics, and are cached per model file, mode, KV cache dtype and code
(engine/cache_dir.py), so later starts read them instead of scoring again. With a KV cache of
another dtype (an fp16 cache for fp32 weights), a mode is scored through it: the text in chunks
that read the earlier tokens back from the cache, as the engine runs them.

`auto` (the default) runs a GGUF's own blocks where the kernels run them and they pass, with no
timing: they are what the file's author chose, the fewest bytes a decode step reads, and faster
than any re-quantization of their dequantized copy on a lone stream on every CPU measured
(BENCHMARKS.md), so a start neither times nor depends on how busy the machine is. Otherwise it
times every mode the checkpoint can run against fp32 on the serving mix (engine/serving_mix.py),
then scores them fastest first and keeps the first that passes. A mode keeps an fp16 KV cache
where its figures through it pass (the cache `auto` asks for), else the model's. fp32 always
qualifies. The decision (mode, cache, timings, figures) is cached per model file, candidates, CPU
features and kernel and scoring code, so a restart neither times nor scores. One timed while other
processes took the cores the timing ran on (engine/cpu_load.py) is kept too, marked with that load,
so a start never waits on a busy machine's second timing: `python -m engine.model_setup --retime`
times it again once the machine is quiet (`make serve` starts it in the background, niced). On
CUDA, or with 16-bit weights, `auto` is fp32: the quantized kernels are CPU code computing in
float32.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from engine.attention.selector import resolve_kv_cache_dtype
from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.cpu_kernels import kernel_build_key
from engine.cpu_load import OtherLoad
from engine.model_loader import Checkpoint
from engine.models.linear import quantize
from engine.quality import KV_CHUNK, TEXT_PATH, WINDOW, Quality, TokenScores, compare, eval_tokens, token_scores
from engine.serving_mix import SERVING_MIX, MixTiming, time_mix

logger = logging.getLogger(__name__)

AUTO_CANDIDATES = ("gguf", "int8", "w4a16", "w8a16")
STORED_MODE = "gguf"  # a GGUF's own blocks; the other candidates re-quantize their dequantized copy
# the code whose arithmetic the figures measure: a change to any of these scores again
_SCORED_CODE = ("models/linear.py", "models/gguf_types.py", "models/decoder.py", "models/families.py", "models/mlp.py",
                "models/rope.py", "models/windows.py", "models/transformers_backend.py", "csrc/block_quant_linear.cpp",
                "csrc/gguf_rows.cpp", "csrc/block_quant_gemm.cpp", "csrc/vector_gemm.cpp", "csrc/decode_stack.cpp",
                "csrc/paged_decode.cpp", "csrc/rope_kv.cpp", "quality.py")


@dataclass(frozen=True)
class Checked:
    model: nn.Module
    mode: str  # the mode it runs (`auto` resolved)
    quality: Quality | None  # against fp32; None for fp32 itself, or when the check is off
    kv_cache_dtype: torch.dtype  # the cache the engine keeps (`auto` resolved)


def check_quantization(checkpoint: Checkpoint, config: ModelConfig, kv_cache_dtype: str = "auto",
                       retime_contended: bool = False) -> Checked:
    """The checkpoint's model quantized as `config.quantization` says, with its figures.
    `kv_cache_dtype`: CacheConfig.kv_cache_dtype, the cache the modes are scored through. The
    fp32 model is quantized in place (`auto` times and scores copies of it first, when it decides).
    `retime_contended`: `auto` times again a cached decision that was timed on a busy machine."""
    fp32_model, stored_blocks, max_model_len = checkpoint.model, checkpoint.stored_blocks, checkpoint.max_model_len
    mode = config.quantization
    device, model_dtype = torch.device(config.device), getattr(torch, config.resolved_dtype)
    if mode == "auto" and (config.device != "cpu" or model_dtype != torch.float32):
        mode = "none"
    if mode == "none":
        return Checked(fp32_model, "none", None, resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, device))
    scorer = _Scorer(fp32_model, checkpoint.tokenizer, config.quality_check_tokens, checkpoint.path,
                     min(WINDOW, max_model_len))
    if mode == "auto":
        return _Chooser(fp32_model, scorer, stored_blocks, kv_cache_dtype, max_model_len).choose(retime_contended)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32, device)
    if config.quality_check_tokens:
        scorer.reference_if_uncached(mode, kv_dtype)
    model = quantize(fp32_model, mode, stored_blocks() if mode == "gguf" else None)
    quality = scorer.quality(model, mode, kv_dtype) if config.quality_check_tokens else None
    if quality is not None:
        log = logger.info if quality.passes else logger.warning
        log("quantization %s: %s on %d tokens of %s%s", mode, quality, config.quality_check_tokens,
            TEXT_PATH.name, "" if quality.passes else f": below the bar ({Quality.BAR})")
    return Checked(model, mode, quality, kv_dtype)


def scoring_order(timings: dict[str, MixTiming]) -> list[str]:
    """The modes faster than fp32 on the serving mix, fastest first. The first of these that
    passes is never beaten on both a lone stream and a saturated server by another that passes:
    one that were would be faster on the mix, and so come first."""
    return sorted((m for m, t in timings.items() if t.mix < 1), key=lambda m: timings[m].mix)


@dataclass(frozen=True)
class Decision:
    """What `auto` chose for a model on this machine, as cached."""
    mode: str
    kv_cache_dtype: str
    quality: dict | None  # Quality's fields, None for fp32
    timings: dict[str, dict[str, float]]  # mode -> SERVING_MIX step -> time over fp32's
    contended_cores: float | None = None  # cores other processes took beyond the timing's share, if they did


def contended_decisions() -> list[Path]:
    """The cached decisions that were timed on a busy machine."""
    return [p for p in cache_dir("decisions").glob("*.json")
            if json.loads(p.read_text()).get("contended_cores") is not None]


class _Chooser:
    """`auto`: reads the cached decision, or times every candidate and scores them in
    scoring_order. Candidates are built one at a time, so memory holds at most two copies of
    the weights."""

    def __init__(self, fp32_model: nn.Module, scorer: _Scorer, stored_blocks, kv_cache_dtype: str,
                 max_model_len: int):
        self.fp32_model, self.scorer, self.stored_blocks = fp32_model, scorer, stored_blocks
        self.max_model_len = max_model_len
        cpu = torch.device("cpu")
        # the caches a mode may keep, preferred first: fp16 where its figures pass, if the user left it to us
        self.kv_options = ([torch.float16, torch.float32] if kv_cache_dtype == "auto"
                           else [resolve_kv_cache_dtype(kv_cache_dtype, torch.float32, cpu)])
        self.candidates = [m for m in AUTO_CANDIDATES if m != STORED_MODE or stored_blocks is not None]
        key = "|".join([scorer.key, kv_cache_dtype, str(max_model_len), ",".join(self.candidates), repr(SERVING_MIX),
                        kernel_build_key(), _code_digest("serving_mix.py"), _code_digest("quantization_check.py")])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = cache_dir("decisions") / f"{Path(scorer.model_path).name}-{digest}.json"

    def build(self, mode: str, last: bool = False) -> nn.Module:
        """The fp32 model in `mode`; a copy unless it is the `last` built (or fp32 itself)."""
        model = self.fp32_model if last or mode == "none" else copy.deepcopy(self.fp32_model)
        return quantize(model, mode, self.stored_blocks() if mode == STORED_MODE else None)

    def choose(self, retime_contended: bool) -> Checked:
        decision = Decision(**json.loads(self.path.read_text())) if self.path.is_file() else None
        if decision is not None and not (retime_contended and decision.contended_cores is not None):
            logger.info("quantization auto: %s with a %s KV cache (decided on this machine before: %s)",
                        decision.mode, decision.kv_cache_dtype, self.path)
            if decision.contended_cores is not None:
                logger.info("quantization auto: that decision was timed while other processes took %.2f cores; "
                            "`python -m engine.model_setup --retime` times it again", decision.contended_cores)
        else:
            load = OtherLoad()
            decision = self.decide(load)
            if decision.timings and load.contends_with(torch.get_num_threads()):
                logger.warning("quantization auto: other processes took %.2f cores while the modes were timed; "
                               "%s is kept marked so, for `python -m engine.model_setup --retime` to time again",
                               load.cores, decision.mode)
                decision = replace(decision, contended_cores=round(load.cores, 2))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.partial-{os.getpid()}")
            partial.write_text(json.dumps(asdict(decision), indent=1))
            partial.replace(self.path)
        quality = Quality(**decision.quality) if decision.quality else None
        return Checked(self.build(decision.mode, last=True), decision.mode, quality,
                       getattr(torch, decision.kv_cache_dtype))

    def decide(self, load: OtherLoad) -> Decision:
        """The GGUF's own blocks if they pass; else times the other candidates, `load` measuring
        the rest of the machine meanwhile, and scores them."""
        stored = self._stored() if STORED_MODE in self.candidates else None
        if stored is not None:
            return stored
        timings = {}
        for mode in self.candidates:
            if mode == STORED_MODE:
                continue
            try:
                model = self.build(mode)
            except ValueError as e:  # e.g. a GGUF whose block types the kernel does not read
                logger.info("quantization auto: %s does not apply: %s", mode, e)
                continue
            with load:
                timings[mode] = time_mix(model, self.fp32_model, self.kv_options[0], self.max_model_len)
            logger.info("quantization auto: %s %s", mode, timings[mode])
        ratios = {mode: t.ratios for mode, t in timings.items()}
        for mode in scoring_order(timings):
            model = self.build(mode)
            for kv_dtype in self.kv_options:
                quality = self.scorer.quality(model, mode, kv_dtype)
                logger.info("quantization auto: %s through a %s KV cache %s, %s", mode, kv_dtype,
                            "passes" if quality.passes else "fails the bar", quality)
                if quality.passes:
                    logger.info("quantization auto chose %s with a %s KV cache (%s)", mode, kv_dtype, timings[mode])
                    return Decision(mode, str(kv_dtype).removeprefix("torch."), asdict(quality), ratios)
        logger.info("quantization auto chose none: no faster mode passes")
        return Decision("none", "float32", None, ratios)

    def _stored(self) -> Decision | None:
        """The GGUF's own blocks with the first KV cache their figures pass through, untimed; None
        where the kernels do not run them or no cache passes."""
        try:
            model = self.build(STORED_MODE)
        except ValueError as e:  # e.g. a GGUF whose block types the kernel does not read
            logger.info("quantization auto: the file's own blocks do not apply: %s", e)
            return None
        for kv_dtype in self.kv_options:
            quality = self.scorer.quality(model, STORED_MODE, kv_dtype)
            logger.info("quantization auto: the file's own blocks (%s) through a %s KV cache %s, %s", STORED_MODE,
                        kv_dtype, "pass" if quality.passes else "fail the bar", quality)
            if quality.passes:
                return Decision(STORED_MODE, str(kv_dtype).removeprefix("torch."), asdict(quality), {})
        return None


class _Scorer:
    """Scores models against the fp32 one, scored at most once; figures cached on disk per mode
    and KV cache dtype."""

    def __init__(self, fp32_model: nn.Module, tokenizer, num_tokens: int, model_path: str, window: int):
        self.fp32_model, self.tokenizer, self.num_tokens = fp32_model, tokenizer, num_tokens
        self.model_path, self.window = model_path, window
        self._reference: TokenScores | None = None
        # what the figures depend on besides the mode and cache: the checkpoint, the text, torch and our code
        self.key = "|".join([_identity(model_path), type(fp32_model).__name__, str(num_tokens), str(window),
                             torch.__version__, *(_code_digest(f) for f in _SCORED_CODE)])

    def reference_if_uncached(self, mode: str, kv_cache_dtype: torch.dtype) -> None:
        """Scores the fp32 model now if `mode`'s figures are not cached (before the fp32 model is
        quantized in place)."""
        if not self._path(mode, kv_cache_dtype).is_file():
            self._reference_scores()

    def quality(self, model: nn.Module, mode: str, kv_cache_dtype: torch.dtype) -> Quality:
        path = self._path(mode, kv_cache_dtype)
        if path.is_file():
            return Quality(**json.loads(path.read_text()))
        chunk = None if kv_cache_dtype == torch.float32 else KV_CHUNK  # an fp32 cache holds the same values
        scores = token_scores(model, self._tokens(), self.window, kv_cache_dtype=kv_cache_dtype, chunk=chunk)
        quality = compare(self._reference_scores(), scores, self.window)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_text(json.dumps(asdict(quality)))
        partial.replace(path)
        return quality

    def _tokens(self) -> list[int]:
        return eval_tokens(self.tokenizer, self.num_tokens)

    def _reference_scores(self) -> TokenScores:
        if self._reference is None:
            self._reference = token_scores(self.fp32_model, self._tokens(), self.window)
        return self._reference

    def _path(self, mode: str, kv_cache_dtype: torch.dtype) -> Path:
        key = hashlib.sha256(f"{mode}|{kv_cache_dtype}|{self.key}".encode())
        return cache_dir("quality") / f"{Path(self.model_path).name}-{mode}-{key.hexdigest()[:16]}.json"


def _identity(path: str) -> str:
    """A checkpoint file or directory by its path, sizes and modification times."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _code_digest(relative: str) -> str:
    return hashlib.sha256((Path(__file__).parent / relative).read_bytes()).hexdigest()
