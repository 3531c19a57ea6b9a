"""Quantization modes on the embedded SmolLM2-135M-Instruct (CPU), interleaved in one run.

Per mode (`none` = fp32, the reference; `int8` = every matmul as GGUF Q8_0 blocks, activations
rounded to bf16; `gguf` = the file's own Q4_1/Q8_0 blocks, activations quantized per block of 32
to 15 bits;
`w8a16`/`w4a16` = int8/int4 weights with bf16 activations, torch's weight-only kernels):
the kernel serving each step size, single-stream decode tok/s (128-token prompt, 128 new tokens, time per output
token after the first), prefill tok/s (one 512-token prompt), the 64-request mixed workload
(prompts 16-512, outputs 8-256: useful output tok/s), matmul weight bytes per decode step, and
teacher-forced quality against fp32 on the shipped text (each engine's start-up check,
engine/quantization_check.py). With --kv-cache-dtype float16 the quantized modes keep their KV
cache in fp16 (`none` stays the fp32 reference), and their quality is scored here instead, the
text fed in chunks of 16 tokens that read the earlier ones back from an fp16 cache
(engine/quality.py's WindowRunner). Each measurement is
taken --repeats times with the modes alternating, and the medians are printed with each run's
process cpu/wall (2 threads: ~2.0 means nothing else took the cores) and the cores' worth of CPU
other processes used meanwhile, then each mode's ratios to fp32 and llama.cpp, on the medians and
round by round (the JSON keeps the rounds). Optional bar chart (`plot`). With a llama.cpp `llama-server` binary
(--llama-server, $LLAMA_SERVER or PATH; build it from the llama-cpp-python sdist's vendored
llama.cpp, out of tree), its server on the same GGUF is measured the same way in the same rounds.

    .venv/bin/python benchmarks/quantization.py [--repeats 3] [--modes none,int8,gguf] [--llama-server BIN]
        [--kv-cache-dtype float16] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import Stopwatch, default_model_path, make_workload, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_kernels import cpu_flags, load_cpu_kernels  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402
from engine.quality import KV_CHUNK, compare, eval_tokens, token_scores  # noqa: E402

MODES = ("none", "int8", "gguf", "w8a16", "w4a16")
LLAMA = "llama.cpp"


def cpu_features() -> str:
    flags = set(cpu_flags().split())
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"]
    return f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}; flags: " + \
        " ".join(f for f in wanted if f in flags)


STEP_ROWS = (1, 4, 8, 32, 64, 512)
PATH_NAMES = {"forward_kernel": "decode kernel", "forward_tiles": "AMX tiles", "forward_vector": "vector GEMM",
              "forward_gemm": "fp32 GEMM"}


def step_paths(llm: LLM) -> str:
    """Which kernel serves each step size in an engine's matmuls (and whether decode steps of that
    size run the fused decode stack)."""
    model = llm.engine.runner.model
    matmuls = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    if not matmuls:
        return "torch's kernels at every size"
    isa = load_cpu_kernels().vector_gemm_isa()
    parts = []
    for rows in STEP_ROWS:
        paths = sorted({PATH_NAMES[m.path(rows)] + (f" ({'avx512_bf16' if m.bf16_activations else isa})"
                                                     if m.path(rows) == "forward_vector" else "") for m in matmuls})
        stack = ", decode steps in the fused stack" if model.decode_stack is not None and rows <= model.decode_rows \
            else ""
        parts.append(f"{rows} rows: {' + '.join(paths)}{stack}")
    return "; ".join(parts)


def bench_engine(mode: str, quality_tokens: int = 6000, kv_cache_dtype: str = "auto", model: str | None = None
                 ) -> LLM:
    """The engine each mode is measured with (no prefix caching: repeats send the same prompts,
    and each must be computed again), on `model` (the embedded one by default)."""
    return LLM(quantization=mode, max_num_seqs=64, max_num_batched_tokens=512, num_threads=2,
               enable_prefix_caching=False, quality_check_tokens=quality_tokens, kv_cache_dtype=kv_cache_dtype,
               **({"model": model} if model else {}))


def quality_with_kv_cache(engines: dict[str, LLM], reference: LLM, num_tokens: int) -> dict:
    """Each engine's quality against the fp32 engine (scored once) with the model's keys and values
    kept in an fp16 cache."""
    tokens = eval_tokens(reference.engine.tokenizer, num_tokens)
    reference_scores = token_scores(reference.engine.loaded.model, tokens)
    return {mode: compare(reference_scores, token_scores(llm.engine.loaded.model, tokens,
                                                         kv_cache_dtype=torch.float16, chunk=KV_CHUNK))
            for mode, llm in engines.items()}


def single_stream(llm: LLM) -> tuple[float, Stopwatch]:
    """(decode tok/s after the first token, the run's Stopwatch)."""
    prompt = random_prompt(128, seed=5)
    with Stopwatch() as first:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    with Stopwatch() as full:
        llm.generate([prompt], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
    return 127 / (full.wall_s - first.wall_s), full


def prefill(llm: LLM) -> tuple[float, Stopwatch]:
    with Stopwatch() as sw:
        llm.generate([random_prompt(512, seed=6)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return 512 / sw.wall_s, sw


def workload(llm: LLM) -> tuple[float, Stopwatch]:
    wl = make_workload(64, seed=0)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in wl.output_lens]
    with Stopwatch() as sw:
        llm.generate(wl.prompts, params, use_tqdm=False)
    return wl.num_output_tokens / sw.wall_s, sw


class LlamaServer:
    """llama.cpp's server on the same GGUF file: 16 slots, 2 threads, no prompt cache, greedy,
    token-id prompts through its /completion API. Decode and prefill rates are the server's own
    timings (generation after the first token; prompt processing); the workload is timed at the
    client, as the engine's is. Stopwatch's `others` counts the server process here."""

    def __init__(self, binary: str, model_path: str, slots: int = 16, context_per_slot: int = 1024):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([binary, "-m", model_path, "-t", "2", "-tb", "2", "-np", str(slots),
                                      "-c", str(slots * context_per_slot), "--host", "127.0.0.1", "--port", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; its log: {self.log.name}")
            time.sleep(0.5)

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        request = urllib.request.Request(f"{self.url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            out = json.loads(r.read())
        if out["tokens_predicted"] != max_tokens:
            raise RuntimeError(f"llama-server predicted {out['tokens_predicted']} tokens, asked {max_tokens}")
        return out

    def single_stream(self) -> tuple[float, Stopwatch]:
        with Stopwatch() as sw:
            out = self.complete(random_prompt(128, seed=5), 128)
        return out["timings"]["predicted_per_second"], sw

    def prefill(self) -> tuple[float, Stopwatch]:
        with Stopwatch() as sw:
            out = self.complete(random_prompt(512, seed=6), 1)
        return out["timings"]["prompt_per_second"], sw

    def workload(self) -> tuple[float, Stopwatch]:
        wl = make_workload(64, seed=0)
        with Stopwatch() as sw, ThreadPoolExecutor(len(wl.prompts)) as pool:
            list(pool.map(self.complete, wl.prompts, wl.output_lens))
        return wl.num_output_tokens / sw.wall_s, sw

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def plot(results: dict, path: str) -> None:
    """Bar chart of single-stream and workload tok/s by system, from main()'s results (or its JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["modes"])
    labels = ["single stream decode", "64-request workload"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        m = results["modes"][name]
        ax.bar([x + width * i for x in range(2)], [m["decode_tok_s"], m["workload_tok_s"]], width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(2)], labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M on 2 CPU cores, by quantization mode")
    ax.legend(ncol=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=6000)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                        help="a llama.cpp server binary to measure beside the engine (default: $LLAMA_SERVER, "
                             "else llama-server on PATH; none found: the engine only)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float16"),
                        help="the quantized modes' KV cache (none stays fp32)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    print(cpu_features())
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    engines = {mode: bench_engine(mode, args.quality_tokens, "auto" if mode == "none" else args.kv_cache_dtype)
               for mode in modes}
    kv_quality = {}
    if args.kv_cache_dtype == "float16":
        reference = engines["none"] if "none" in engines else bench_engine("none", 0)
        kv_quality = quality_with_kv_cache({mode: llm for mode, llm in engines.items() if mode != "none"},
                                           reference, args.quality_tokens)
    for mode, llm in engines.items():
        print(f"{mode}: {step_paths(llm)}")
    for llm in engines.values():  # warm-up: kernels, allocator
        llm.generate([random_prompt(64)], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    systems = {mode: {"decode_tok_s": partial(single_stream, llm), "prefill_tok_s": partial(prefill, llm),
                      "workload_tok_s": partial(workload, llm)} for mode, llm in engines.items()}
    server = None
    if args.llama_server:
        server = LlamaServer(args.llama_server, default_model_path())
        server.complete(random_prompt(64), 8)  # warm-up
        systems[LLAMA] = {"decode_tok_s": server.single_stream, "prefill_tok_s": server.prefill,
                          "workload_tok_s": server.workload}
    names = list(systems)
    runs: dict = {name: {m: [] for m in systems[name]} for name in names}
    try:
        for r in range(args.repeats):
            for measure in runs[names[0]]:
                for name in names if r % 2 == 0 else reversed(names):
                    value, sw = systems[name][measure]()
                    runs[name][measure].append(value)
                    others = "n/a" if sw.others is None else f"{sw.others:.2f}"
                    print(f"run {r} {name:9} {measure:15} {value:8.1f}  cpu/wall {sw.cpu_util:.2f}  others {others}",
                          flush=True)
    finally:
        if server is not None:
            server.close()

    results: dict = {"cpu": cpu_features(), "kv_cache_dtype": args.kv_cache_dtype, "modes": {},
                     "step_paths": {mode: step_paths(llm) for mode, llm in engines.items()}}
    for name in names:  # quality: the figures each engine's start-up check measured (engine/quantization_check.py)
        loaded = engines[name].engine.loaded if name in engines else None
        quality = kv_quality.get(name, None if loaded is None else loaded.quality)
        results["modes"][name] = {
            **{measure: statistics.median(values) for measure, values in runs[name].items()},
            "weight_mb_per_decode_step": None if loaded is None else loaded.weight_bytes_per_token / 1e6,
            "top1_agreement": None if loaded is None else 1.0 if quality is None else quality.top1_agreement,
            "perplexity_increase": None if loaded is None else 0.0 if quality is None else quality.perplexity_increase,
        }
    print(f"\nmedians of {args.repeats}; quality on {args.quality_tokens} tokens of engine/data/english.txt")
    print(f"{'mode':9} {'decode tok/s':>12} {'prefill tok/s':>13} {'64-req tok/s':>12} {'MB/step':>8} "
          f"{'top-1 agree':>11} {'ppl vs fp32':>11}")
    for name, m in results["modes"].items():
        quality = "" if m["top1_agreement"] is None else \
            f"{m['weight_mb_per_decode_step']:8.0f} {m['top1_agreement']:11.4f} {m['perplexity_increase']:+11.2%}"
        print(f"{name:9} {m['decode_tok_s']:12.1f} {m['prefill_tok_s']:13.1f} {m['workload_tok_s']:12.1f} {quality}")
    for reference in [r for r in ("none", LLAMA) if r in results["modes"]]:
        base = results["modes"][reference]
        for name, m in results["modes"].items():
            ratios = {k: m[k] / base[k] for k in ("decode_tok_s", "prefill_tok_s", "workload_tok_s")}
            print(f"{name}/{reference}: decode x{ratios['decode_tok_s']:.2f}, prefill x{ratios['prefill_tok_s']:.2f}, "
                  f"64-req x{ratios['workload_tok_s']:.2f}")
            for measure, values in runs[name].items():  # the machine drifts: each round against its own baseline
                by_round = [v / b for v, b in zip(values, runs[reference][measure])]
                print(f"    {measure} by round: " + " ".join(f"{r:.2f}" for r in by_round))
    results["rounds"] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
