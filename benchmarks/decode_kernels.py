"""Single-stream decode on the embedded model's GGUF blocks: this tree's C++ kernels against another
revision's (`--baseline REF`: engine/csrc as git holds it there, built for this CPU into the kernel
cache), both in one process on the same loaded weights, alternated round by round.

Per build and round: the step's block-quantized matmuls by kind (one token; each of a layer's four
across all layers, and the LM head), the fused decode stack replayed on captured decode steps of
one, two and four requests (`stack`, `stack_2`, `stack_4`: the decode kernel takes up to
BlockQuantLinear.VECTOR_DECODE_ROWS tokens a step), and the engine's decode time per token
(quantization.py's single stream: 127 more tokens after a 128-token prompt's first). Medians
over the rounds, and the median of the rounds' ratios baseline / this tree.
`--march haswell` (a cpu_kernels.TARGETS family) times both builds for that family instead of this
CPU's own, so each vector branch this CPU runs gets its figures.

    python benchmarks/decode_kernels.py --baseline HEAD~1 [--march haswell] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks.quantization import cpu_features, single_stream  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_kernels import kernel_build_key, load_cpu_kernels, load_kernels_from  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402

ROOT = Path(__file__).parents[1]
KINDS = ("qkv", "o", "gate_up", "down")
STACK_TOKENS = {"stack": 1, "stack_2": 2, "stack_4": 4}  # a replayed decode step's tokens (requests)


def kernels_at(ref: str, march: str):
    """The kernels of engine/csrc at git revision `ref`, built for `march`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, "engine/csrc/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    csrc = Path(tempfile.mkdtemp(prefix="csrc_")) / "csrc"
    csrc.mkdir()
    for name in names:
        blob = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
        (csrc / Path(name).name).write_bytes(blob)
    return load_kernels_from(csrc, march)


def use(model, kernels) -> None:
    """Runs the model's block-quantized matmuls and fused stack on `kernels`."""
    for m in model.modules():
        if isinstance(m, BlockQuantLinear):
            m._kernels = kernels
    model.fuse_decode_stack(kernels)


def best_of(f, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_ms(model, repeats: int) -> dict[str, float]:
    """ms per step of each kind of matmul at one token: every layer's (or the LM head's) in turn."""
    out = {}
    groups = {kind: [getattr(layer, kind) for layer in model.layers] for kind in KINDS} | {"lm_head": [model.lm_head]}
    for kind, matmuls in groups.items():
        swiglu = kind == "down"
        x = torch.randn(1, matmuls[0].weight.shape[1] * (2 if swiglu else 1))

        def sweep(matmuls=matmuls, x=x, swiglu=swiglu):
            for m in matmuls:
                m.forward_kernel(x, swiglu=swiglu)
        out[kind] = 1e3 * best_of(sweep, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose engine/csrc is the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30, help="best of this many per matmul sweep and stack replay")
    ap.add_argument("--march", default="native", help="the builds' CPU family: native, or a cpu_kernels.TARGETS key")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.march != "native":
        os.environ["CBSERVE_CPU_MARCH"] = args.march  # the engine loads this tree's build for that family

    print(f"CPU: {cpu_features()}; threads {torch.get_num_threads()}; this tree's kernels {kernel_build_key()}")
    builds = {"baseline": kernels_at(args.baseline, args.march), "this tree": load_cpu_kernels()}
    llm = LLM()  # the embedded model in its default mode (its GGUF blocks)
    model = llm.engine.runner.model
    captured = []
    stack = model.decode_stack

    class Capture:  # one decode step's arguments, replayed on each build's stack
        def forward(self, *args):
            captured.append(args)
            return stack.forward(*args)

    model.decode_stack = Capture()
    steps = {}
    for name, tokens in STACK_TOKENS.items():
        prompts = [list(range(500 + 300 * j, 756 + 300 * j)) for j in range(tokens)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        steps[name] = next(args for args in reversed(captured) if args[0].shape[0] == tokens)  # all decoding
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(args.rounds):
        for name, kernels in builds.items():
            use(model, kernels)
            figures = matmul_ms(model, args.repeats)
            figures["matmuls"] = sum(figures[k] for k in KINDS) + figures["lm_head"]
            for stack, step in steps.items():
                figures[stack] = 1e3 * best_of(lambda step=step: model.decode_stack.forward(*step), args.repeats)
            figures["decode_ms_per_token"] = 1e3 / single_stream(llm)[0]
            rounds[name].append(figures)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    medians = {name: {k: statistics.median(f[k] for f in rs) for k in rs[0]} for name, rs in rounds.items()}
    # each round's own ratio first: the machine's speed drifts between rounds, not within one
    ratios = {k: statistics.median(b[k] / n[k] for b, n in zip(rounds["baseline"], rounds["this tree"]))
              for k in medians["this tree"]}
    print(f"\n| ms (median of {args.rounds} rounds) | baseline ({args.baseline}) | this tree | "
          "baseline / this tree (median of the rounds' ratios) |")
    print("|---|---|---|---|")
    for k in medians["this tree"]:
        print(f"| {k} | {medians['baseline'][k]:.3f} | {medians['this tree'][k]:.3f} | {ratios[k]:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "march": args.march, "baseline": args.baseline,
                                               "rounds": rounds, "medians": medians, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
