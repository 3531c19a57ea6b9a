"""Speculative decoding on the embedded model: plain decoding vs n-gram drafts, self-drafts (the
target's first quarter of layers) and the model's own GGUF blocks as a draft model of the fp32
target (`gguf_draft`), each with a fixed k and with adaptive k, same run.

`self_draft_actor` runs the self-draft in the DraftModel Ray Serve deployment (placement `actor`,
its own process and KV cache, one call per step) on a local Ray cluster the benchmark starts; the
median round trip of an empty call (the hop) is printed first.

Two workloads: extraction (the answer repeats a passage of the prompt) and free chat. For each
batch size, the three engines' runs alternate (`--repeats` rounds); the figure is the median
output tokens per second, with the ratio to plain, and for the last round the acceptance rate,
drafts verified and steps; each round's ratio to plain's in the same round, with the drafts it
verified, is listed too. Outputs are checked identical (greedy). Each engine lives through the
whole run, as a server would, so the adaptive one measures its step cost as it goes.

    python benchmarks/speculative.py [--batch-sizes 1,4,16,64] [--repeats 3] [--k 4] [--plot speedup.png]
        [--modes plain,ngram,ngram_adaptive,self_draft,self_draft_adaptive,self_draft_actor,gguf_draft,
                 gguf_draft_adaptive]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks.workload import Stopwatch  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import default_model_path  # noqa: E402

PASSAGES = [
    "Continuous batching keeps the accelerator busy by adding new requests to the running batch at every "
    "step, while a paged key-value cache lets many requests share memory without fragmentation.",
    "The committee met on Tuesday to review the budget, approved the new library wing, and asked the "
    "treasurer to publish the quarterly accounts before the end of the month.",
    "def add(a, b):\n    return a + b\n\ndef multiply(a, b):\n    return a * b\n",
    "Rivers carry sediment from the mountains to the sea, building deltas where the current slows and the "
    "fine sand settles into broad, fertile plains.",
]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "Why is the sky blue?"]


def workload(name: str, batch: int) -> list[list[dict]]:
    if name == "extraction":
        items = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
    else:
        items = QUESTIONS
    return [[{"role": "user", "content": items[i % len(items)]}] for i in range(batch)]


# the fp32 target drafted by its own GGUF blocks (the embedded file, quantization gguf)
GGUF_DRAFT = {"method": "draft_model", "model": default_model_path(), "quantization": "gguf"}
MODES = {"plain": None,
         "ngram": {"method": "ngram", "adaptive": False}, "ngram_adaptive": {"method": "ngram", "adaptive": True},
         "self_draft": {"method": "self_draft", "adaptive": False},
         "self_draft_adaptive": {"method": "self_draft", "adaptive": True},
         # the placement is measured, not the deadline: one well above the draft's own time
         "self_draft_actor": {"method": "self_draft", "adaptive": False, "placement": "actor", "deadline_s": 5.0},
         "gguf_draft": {**GGUF_DRAFT, "adaptive": False}, "gguf_draft_adaptive": {**GGUF_DRAFT, "adaptive": True}}
DRAFT_APP = "bench-drafts"


def start_draft_actor(spec: dict, tmp: str) -> float:
    """A local Ray cluster with the DraftModel deployment of `spec` (its own process, as under
    `serve run`); returns the median ms of an empty call's round trip from this process (the hop
    every engine step pays on top of the drafting itself)."""
    import os

    import ray
    from ray import serve

    from engine.config import EngineConfig
    from engine.drafts import DraftCall
    from serve_app.draft import DRAFT_DEPLOYMENT, DraftModel

    os.environ.setdefault("RAY_TMPDIR", tmp)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = EngineConfig.from_kwargs(speculative_config=spec)
    deployment = serve.deployment(DraftModel, name=DRAFT_DEPLOYMENT, ray_actor_options={"num_cpus": 0})
    handle = serve.run(deployment.bind(config, 2), name=DRAFT_APP, route_prefix=None)
    times = []
    for _ in range(60):
        with Stopwatch() as clock:
            handle.propose.remote(DraftCall([], [])).result()
        times.append(clock.wall_s * 1e3)
    return statistics.median(times[10:])


def actor_transport(spec: dict | None):
    """The transport to the DraftModel of start_draft_actor, for an actor-placed spec."""
    if spec is None or spec.get("placement") != "actor":
        return None
    from serve_app.draft import ServeDraftTransport

    return functools.partial(ServeDraftTransport, DRAFT_APP, spec["deadline_s"])


def run(llm: LLM, chats: list[list[dict]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    before = llm.engine.get_stats()
    with Stopwatch() as clock:
        outputs = llm.chat(chats, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    after = llm.engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outputs]
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    return sum(map(len, tokens)) / clock.wall_s, tokens, {
        "steps": after.num_steps - before.num_steps, "proposed": proposed, "accepted": accepted}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    for workload_name, marker in (("extraction", "o"), ("chat", "s")):
        mine = [r for r in rows if r["workload"] == workload_name]
        for mode in [m for m in MODES if m != "plain" and f"{m}_ratio" in rows[0]]:
            method, adaptive = mode.removesuffix("_adaptive"), mode.endswith("_adaptive")
            ax.plot([r["batch"] for r in mine], [r[f"{mode}_ratio"] for r in mine], "-" if adaptive else "--",
                    marker=marker, label=f"{workload_name}, {method}, {'adaptive' if adaptive else 'fixed'} k")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(0.95, color="grey", linewidth=0.8, linestyle=":", label="0.95x plain")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tok/s, ratio to plain decoding")
    ax.set_title("speculative decoding, SmolLM2-135M on CPU")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize="small")  # below: never over a line
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--plot", help="write a PNG of the speed-up against batch size here")
    parser.add_argument("--modes", default=",".join(MODES), help="engines to compare (plain always runs)")
    args = parser.parse_args()
    modes = ["plain"] + [m for m in args.modes.split(",") if m != "plain"]
    specs = {mode: None if MODES[mode] is None else {"num_speculative_tokens": args.k, **MODES[mode]}
             for mode in modes}
    for spec in specs.values():
        if spec is not None and spec.get("placement") == "actor":
            hop_ms = start_draft_actor(spec, tempfile.mkdtemp(prefix="ray-"))
            print(json.dumps({"draft_hop_ms": round(hop_ms, 2)}), flush=True)
    llms = {mode: LLM(speculative_config=spec, draft_transport=actor_transport(spec)) for mode, spec in specs.items()}
    rows = []
    for name in ("extraction", "chat"):
        for batch in map(int, args.batch_sizes.split(",")):
            chats = workload(name, batch)
            speeds: dict[str, list[float]] = {mode: [] for mode in llms}
            outputs, counts = {}, {mode: [] for mode in llms}
            for _ in range(args.repeats):
                for mode, llm in llms.items():  # interleaved: drift hits all alike
                    tok_s, outputs[mode], spec = run(llm, chats, args.max_tokens)
                    speeds[mode].append(tok_s)
                    counts[mode].append(spec)
            plain = statistics.median(speeds["plain"])
            row = {"workload": name, "batch": batch, "plain_tok_s": round(plain, 1),
                   "steps_plain": counts["plain"][-1]["steps"]}
            for mode in modes[1:]:
                assert outputs[mode] == outputs["plain"], f"{name} batch {batch} {mode}: outputs differ"
                spec, tok_s = counts[mode][-1], statistics.median(speeds[mode])
                # each repeat against plain's in the same repeat, with the drafts it verified: a
                # repeat that verified none ran plain steps, so its ratio is the machine's noise
                by_repeat = [(round(t / p, 2), c["proposed"]) for t, p, c in zip(speeds[mode], speeds["plain"],
                                                                                 counts[mode])]
                row |= {f"{mode}_tok_s": round(tok_s, 1), f"{mode}_ratio": round(tok_s / plain, 2),
                        f"{mode}_acceptance": round(spec["accepted"] / max(spec["proposed"], 1), 2),
                        f"{mode}_proposed": spec["proposed"], f"{mode}_steps": spec["steps"],
                        f"{mode}_ratio_and_drafts_by_repeat": by_repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
