"""A fresh engine's first burst on one NVIDIA GPU against its second: what kernels compiled on first
use cost the first requests after a start (a new replica, one autoscaling adds under load). Triton
compiles into a cache of its own, new unless --keep-cache (as on a fresh host or pod); the model
of benchmarks/cuda_engine.py's shapes, bfloat16, the engine sizes of configs/serve-gpu.yaml with
the pool sized from the GPU, prefix caching off (so the second burst reuses no prefill); the
workload of benchmarks/serve_bench.py, all at once, twice on the same engine.

    python benchmarks/investigations/cuda_first_burst.py [--model smollm2-135m] [--num-requests 256] [--json OUT]
"""
import argparse
import json
import os
import sys
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--num-requests", type=int, default=256)
parser.add_argument("--keep-cache", action="store_true", help="Triton's own cache dir (kernels of earlier runs)")
parser.add_argument("--json")
args = parser.parse_args()
if not args.keep_cache:  # before Triton is imported
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import statistics  # noqa: E402

import torch  # noqa: E402

from benchmarks.cuda_engine import SHAPES, shaped_model  # noqa: E402
from benchmarks.workload import make_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.runner.model_runner import triton_variants  # noqa: E402


def burst(llm: LLM, prompts, params) -> dict:
    before = triton_variants()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = sorted(o.metrics.ttft for o in outputs)
    return {"wall_s": wall, "output_tps": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": ttfts[-1], "kernel_variants_compiled": triton_variants() - before}


def main() -> None:
    workload = make_workload(args.num_requests)  # serve_bench.py's (seed 0, token ids under 49,152)
    prompts = [list(p) for p in workload.prompts]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    with tempfile.TemporaryDirectory() as tmp:
        model = shaped_model(tmp, SHAPES[args.model])
        t0 = time.perf_counter()
        llm = LLM(model, device="cuda", max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_caching=False)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                  "fresh_triton_cache": not args.keep_cache, "start_s": time.perf_counter() - t0,
                  "kernel_variants_at_start": triton_variants()}
        result["first"] = burst(llm, prompts, params)
        result["second"] = burst(llm, prompts, params)
    for name in ("first", "second"):
        b = result[name]
        print(f"{name:6s} burst: {b['wall_s']:.2f} s, {b['output_tps']:,.0f} output tok/s, TTFT p50 "
              f"{b['ttft_p50_s'] * 1e3:.0f} ms, max {b['ttft_max_s'] * 1e3:.0f} ms, "
              f"{b['kernel_variants_compiled']} kernel variants compiled")
    print(f"start {result['start_s']:.1f} s, {result['kernel_variants_at_start']} kernel variants compiled by then")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
