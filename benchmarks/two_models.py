"""Two models in one app: does a burst on one model leave the other model's time to first token alone?

The app, launched as `serve_bench.py --launch` does (a private Ray + Serve, the front door `make serve`
picks), serves the embedded SmolLM2-135M in its default mode and a Qwen3-shaped model (random weights,
SmolLM2's tokenizer, 8 layers of hidden size 512, made here), each in its own EngineReplica deployment
with one core's worth of threads (configs/serve-models.yaml's layout). In each of --rounds rounds, in
alternating order: the steady stream alone (Poisson arrivals at --rate req/s on the steady model for
--seconds, 64-256-token prompts, 32 tokens out), and the same stream (same arrivals and lengths, fresh
prompts, so neither phase hits the prefix cache the other filled) with a burst of the 64-request mixed
workload (benchmarks/workload.py) sent to the other model at its start; an untimed warm-up on both
models first. Reported: the steady stream's TTFT p50/p99 alone and beside the burst, their ratio
(median over rounds), and the burst's output tok/s; both directions (--steady both).

    .venv/bin/python benchmarks/two_models.py [--rounds 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.serve_bench import RequestResult, _pcts, arrival_offsets, launched_app, stream_request  # noqa: E402
from benchmarks.workload import make_workload, random_prompt  # noqa: E402
from engine.model_loader import hf_directory  # noqa: E402

EMBEDDED, QWEN3 = "SmolLM2-135M-Instruct", "qwen3-shaped"


def make_qwen3(directory: Path) -> str:
    """A random Qwen3 with SmolLM2's tokenizer, about the embedded model's size in fp32."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(hf_directory(None))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def app_config(qwen3: str) -> dict:
    def model(path: str | None, name: str | None, engine_args: dict) -> dict:
        return {"model": path, "served_model_name": name, "num_cpus": 0.9, "stream_flush_interval_s": 0.1,
                "engine_args": {"device": "cpu", "max_num_seqs": 32, "max_num_batched_tokens": 512,
                                "policy": "priority", "enable_prefix_caching": True, "num_threads": 1,
                                **engine_args}}

    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
            "applications": [{"name": "cbserve", "route_prefix": "/", "import_path": "serve_app.app:app_builder",
                              "args": {"models": [model(None, None, {}), model(qwen3, QWEN3, {})],
                                       "router": {"policy": "priority", "max_queued_requests": 256}}}]}


async def _run(session, url: str, model: str, requests: list[tuple[list[int], int, float]]) -> list[RequestResult]:
    """(prompt ids, output tokens, arrival offset) each, streamed; their results."""
    t_start = time.perf_counter()
    results = [RequestResult(i, len(p), n, off) for i, (p, n, off) in enumerate(requests)]

    async def launch(prompt: list[int], n: int, res: RequestResult) -> None:
        delay = res.scheduled_s - (time.perf_counter() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)
        await stream_request(session, url, model, prompt, n, res, t_start, {})

    await asyncio.gather(*(launch(p, n, res) for (p, n, _), res in zip(requests, results)))
    return results


def steady_requests(rate: float, seconds: float, seed: int, salt: int) -> list[tuple[list[int], int, float]]:
    """The steady stream of `seed` (arrivals and lengths), its prompts' tokens drawn afresh for each
    `salt`, so no phase's prompts hit the prefix cache another phase filled."""
    import random

    rng = random.Random(seed)
    offsets = [t for t in arrival_offsets(int(rate * seconds * 2) + 1, rate, seed) if t < seconds]
    return [(random_prompt(rng.randint(64, 256), seed=salt * 100_003 + i), 32, t) for i, t in enumerate(offsets)]


def burst_requests(seed: int) -> list[tuple[list[int], int, float]]:
    return [(r.prompt_token_ids, r.output_len, 0.0) for r in make_workload(64, seed=seed).requests]


_salts = iter(range(1, 1 << 30))  # each phase's prompts their own


async def one_phase(base: str, steady_model: str, burst_model: str | None, args: argparse.Namespace,
                    seed: int) -> dict:
    import aiohttp

    url = base + "/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=600.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200), timeout=timeout) as session:
        steady = _run(session, url, steady_model, steady_requests(args.rate, args.seconds, seed, next(_salts)))
        if burst_model is None:
            steady_results, burst_results = await steady, []
        else:
            steady_results, burst_results = await asyncio.gather(
                steady, _run(session, url, burst_model, burst_requests(seed)))
    failed = [r.error for r in steady_results + burst_results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    ttft = _pcts([r.ttft_s for r in steady_results])
    out = {"steady_requests": len(steady_results), "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"]}
    if burst_results:
        wall = max(r.scheduled_s + r.e2e_s for r in burst_results)
        out["burst_output_tok_per_s"] = sum(r.output_tokens for r in burst_results) / wall
    return out


async def warm_up(base: str) -> None:
    """Untimed: 16 requests of the mixed workload on each model at once, then each model's steady
    prompts, so no timed phase pays a first step's costs."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        burst = burst_requests(seed=99)[:16]
        await asyncio.gather(*(_run(session, base + "/completions", m, burst) for m in (EMBEDDED, QWEN3)))
        for m in (EMBEDDED, QWEN3):
            await _run(session, base + "/completions", m, steady_requests(4.0, 2.0, 99, next(_salts)))


def direction(base: str, steady_model: str, burst_model: str, args: argparse.Namespace) -> dict:
    rounds = []
    for k in range(args.rounds):  # the phases' order alternates: neither always follows the other
        phases = [None, burst_model] if k % 2 == 0 else [burst_model, None]
        alone, beside = sorted((asyncio.run(one_phase(base, steady_model, b, args, seed=k)) for b in phases),
                               key=lambda phase: "burst_output_tok_per_s" in phase)
        rounds.append({"alone": alone, "beside_burst": beside,
                       "p99_ratio": beside["ttft_p99_s"] / alone["ttft_p99_s"]})
        print(f"  steady {steady_model}, burst {burst_model}, round {k}: TTFT p99 {alone['ttft_p99_s'] * 1e3:.0f} ms "
              f"alone, {beside['ttft_p99_s'] * 1e3:.0f} ms beside the burst ({rounds[-1]['p99_ratio']:.2f}x)",
              flush=True)
    return {"rounds": rounds, "median_p99_ratio": statistics.median(r["p99_ratio"] for r in rounds),
            "median_p99_alone_s": statistics.median(r["alone"]["ttft_p99_s"] for r in rounds),
            "median_p99_beside_s": statistics.median(r["beside_burst"]["ttft_p99_s"] for r in rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=2.0, help="steady stream, requests/s")
    p.add_argument("--seconds", type=float, default=20.0, help="steady stream length per phase")
    p.add_argument("--steady", choices=[EMBEDDED, QWEN3, "both"], default="both")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        qwen3 = make_qwen3(Path(tmp) / "qwen3")
        config = Path(tmp) / "serve.yaml"
        config.write_text(yaml.safe_dump(app_config(qwen3)))
        with launched_app(str(config), None, None, 600) as (base, _):
            asyncio.run(warm_up(base))
            pairs = [(EMBEDDED, QWEN3), (QWEN3, EMBEDDED)]
            results = {f"steady_{s}_burst_{b}": direction(base, s, b, args)
                       for s, b in pairs if args.steady in ("both", s)}
    out = {"cpu": cpu_features(), "rate": args.rate, "seconds": args.seconds, "directions": results}
    print(json.dumps({k: {m: v[m] for m in ("median_p99_ratio", "median_p99_alone_s", "median_p99_beside_s")}
                      for k, v in results.items()}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
