"""LoRA adapters on the embedded model (SmolLM2-135M in its default mode): what serving them costs.

Eight rank-16 adapters on all seven projections (random A and B, made with peft on the embedded
model's shapes), in one engine beside the base, alternated within each of --rounds rounds:
- single-stream decode tok/s (128-token prompt, 128 new), base and with an adapter;
- the 64-request mixed workload's output tok/s, on the base alone and spread over the 8 adapters
  (request i runs adapter i % 8, so every step mixes them);
- an adapter not yet held: its read time, its request's time to first token against a held
  adapter's and no adapter's, and the TPOT of 8 base streams while it loads and runs, against the
  same request with the adapter held, without an adapter, and no 9th request.

    .venv/bin/python benchmarks/lora.py [--rounds 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import cpu_features, single_stream, workload  # noqa: E402
from benchmarks.workload import Stopwatch, make_workload, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import hf_directory  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(directory: Path, count: int, rank: int = 16) -> list[str]:
    """`count` PEFT adapters over the embedded model's shapes, saved under `directory`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_directory(None))
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=rank, lora_alpha=rank, target_modules=PROJECTIONS, init_lora_weights=False))
        model.save_pretrained(directory / f"a{i}")
        paths.append(str(directory / f"a{i}"))
    return paths


def with_adapters(llm: LLM, names: list[str | None]) -> tuple[float, float]:
    """(single-stream decode tok/s, 64-request workload tok/s) with `names` cycled over requests."""
    prompt = random_prompt(128, seed=5)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False, lora=names[0])
    t1 = time.perf_counter()
    llm.generate([prompt], full, use_tqdm=False, lora=names[0])
    t2 = time.perf_counter()
    single = 127 / ((t2 - t1) - (t1 - t0))
    wl = make_workload(64, seed=0)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in wl.output_lens]
    t3 = time.perf_counter()
    llm.generate(wl.prompts, params, use_tqdm=False, lora=[names[i % len(names)] for i in range(len(wl.prompts))])
    return single, wl.num_output_tokens / (time.perf_counter() - t3)


def cold_load(llm: LLM, path: str, name: str) -> dict:
    """8 base streams decoding 96 tokens, a 9th request (64-token prompt, 16 new) arriving among
    them: with no adapter, with an adapter held, and with one not yet held (read as it arrives).
    Each TPOT is the streams' median of their mean time per token."""
    engine = llm.engine
    prompts = [random_prompt(64, seed=20 + i) for i in range(8)]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)

    def run(extra: str | None, joins: bool = True) -> tuple[float, float | None]:
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        for _ in range(8):  # the streams decoding before it arrives
            engine.step()
        if joins:
            engine.add_request("extra", random_prompt(64, seed=40), SamplingParams(max_tokens=16, temperature=0),
                               lora=extra)
        ttft, stamps = None, {f"s{i}": [] for i in range(8)}
        while engine.has_unfinished_requests():
            for event in engine.step():
                if event.request_id in stamps:
                    stamps[event.request_id].append(time.perf_counter())
                elif ttft is None and event.outputs[0].token_ids:
                    ttft = event.metrics.ttft
        tpot = statistics.median(statistics.mean(b - a for a, b in zip(s, s[1:])) for s in stamps.values())
        return tpot, ttft

    engine.adapters.register(name, path)
    alone, _ = run(None, joins=False)
    base, base_ttft = run(None)
    cold, cold_ttft = run(name)
    read_s = engine.adapters.loaded[name].load_seconds
    warm, warm_ttft = run(name)
    return {"tpot_alone_ms": alone * 1e3, "tpot_with_base_ms": base * 1e3, "tpot_with_warm_ms": warm * 1e3,
            "tpot_with_cold_ms": cold * 1e3, "cold_over_warm": cold / warm, "cold_over_base": cold / base,
            "read_s": read_s, "base_ttft_s": base_ttft, "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"CPU: {cpu_features()}; threads {torch.get_num_threads()}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    paths = make_adapters(directory, 9)
    names = [f"a{i}" for i in range(8)]
    llm = LLM(enable_lora=True, lora_modules=[f"{n}={p}" for n, p in zip(names, paths)], max_num_seqs=64,
              max_num_batched_tokens=512)
    print(f"mode {llm.engine.model_report.quantization}, decode stack "
          f"{'on' if llm.engine.runner.model.decode_stack is not None else 'off'}", flush=True)
    llm.generate([random_prompt(16, seed=1)], SamplingParams(max_tokens=2), use_tqdm=False, lora=names)  # load all
    single_stream(llm), workload(llm), with_adapters(llm, names)  # a round untimed: caches and allocator warm
    rounds = []
    for r in range(args.rounds):
        with Stopwatch() as watch:
            base_single, base_workload = single_stream(llm)[0], workload(llm)[0]
            lora_single, lora_workload = with_adapters(llm, names)
        rounds.append({"base_single": base_single, "lora_single": lora_single, "base_workload": base_workload,
                       "lora_workload": lora_workload})
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1].items())
              + f" (other processes: {watch.others:.2f} cores)", flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    medians |= {f"{kind}_ratio": statistics.median(r[f"lora_{kind}"] / r[f"base_{kind}"] for r in rounds)
                for kind in ("single", "workload")}
    cold = cold_load(llm, paths[8], "cold")
    print(f"\nmedians of {args.rounds} rounds (tok/s; the ratio: the median of the rounds' ratios): single stream "
          f"{medians['base_single']:.1f} base, {medians['lora_single']:.1f} with an adapter "
          f"({medians['single_ratio']:.2f}x); 64-request workload {medians['base_workload']:.1f} base, "
          f"{medians['lora_workload']:.1f} over 8 adapters ({medians['workload_ratio']:.2f}x)")
    print(f"an adapter not held: read in {cold['read_s']:.3f} s; its request's TTFT {cold['cold_ttft_s']:.3f} s "
          f"(adapter held {cold['warm_ttft_s']:.3f} s, no adapter {cold['base_ttft_s']:.3f} s); 8 base streams' TPOT "
          f"{cold['tpot_alone_ms']:.1f} ms alone, with the 9th request {cold['tpot_with_base_ms']:.1f} ms (no "
          f"adapter), {cold['tpot_with_warm_ms']:.1f} ms (held), {cold['tpot_with_cold_ms']:.1f} ms (not held): "
          f"cold / held {cold['cold_over_warm']:.2f}x, cold / no adapter {cold['cold_over_base']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "rounds": rounds, "medians": medians,
                                               "cold": cold}, indent=1))


if __name__ == "__main__":
    main()
