"""Offline throughput benchmark: cbserve engine vs transformers, SmolLM2-135M-Instruct fp32 on CPU.

One run measures, on the same seeded workload (random token ids, log-uniform prompt/output lengths,
greedy, ignore_eos so every request generates exactly its output length):

  (a) engine, continuous batching      LLM(**engine_args).generate(...)
  (b) engine, static policy            LLM(policy="static", **engine_args)
  (c) transformers static batching     model.generate, left padding, batches in arrival order
  (d) transformers continuous batching model.continuous_batching_context_manager(...)

plus single-stream decode tok/s (128-token prompt, 128 new tokens; median of 3) and prefill tok/s
(512-token prompt) for the engine and for transformers, and the ratios the project targets.

    nice -n 10 .venv/bin/python benchmarks/throughput.py [--quick] [--skip-hf] [--json OUT]
                                                       [--engine-arg key=value ...] [--threads N]

Shared machines: each timed section first waits (--quiet-wait, default 120 s) for other processes
to go quiet, and the report shows per measurement this process's CPU utilisation and the cores
other processes used meanwhile. With torch's 2 threads and any competing process, decode gets
15-25x slower here, so only trust rows whose "others" column is near 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.workload import (  # noqa: E402
    QUIET_WAIT,
    RunResult,
    Stopwatch,
    Workload,
    default_model_path,
    make_workload,
    parse_engine_args,
    random_prompt,
    rate_summary,
    warmup_prompts,
)

TARGETS = {
    "continuous / best HF static": 4.0,
    "continuous / best HF continuous": 2.0,
    "continuous / engine static": 2.0,
    "single-stream engine / HF decode": 2.5,
}

SINGLE_PROMPT_LEN = 128
SINGLE_NEW_TOKENS = 128
PREFILL_LEN = 512
REPEATS = 3


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- #
# engine side                                                                                    #
# --------------------------------------------------------------------------------------------- #


def _engine_generate(llm, SamplingParams, prompts: list[list[int]], out_lens: list[int]):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in out_lens]
    prompts = [list(p) for p in prompts]
    with Stopwatch() as sw:
        outs = llm.generate(prompts, params, use_tqdm=False)
    if len(outs) != len(prompts):
        raise RuntimeError(f"engine returned {len(outs)} outputs for {len(prompts)} prompts")
    toks = []
    for i, (o, n) in enumerate(zip(outs, out_lens)):
        got = list(o.outputs[0].token_ids)
        if len(got) != n:
            raise RuntimeError(
                f"engine request {i} generated {len(got)} tokens, expected {n} "
                f"(finish_reason={o.outputs[0].finish_reason!r})"
            )
        if list(o.prompt_token_ids) != list(prompts[i]):
            raise RuntimeError(f"engine request {i}: outputs are not in input order (prompt_token_ids differ)")
        toks.append(got)
    return sw, toks


def engine_workload(llm, SamplingParams, wl: Workload, name: str):
    _engine_generate(llm, SamplingParams, warmup_prompts(), [4, 4])
    sw, toks = _engine_generate(llm, SamplingParams, wl.prompts, wl.output_lens)
    return RunResult.from_stopwatch(name, sw, wl.num_prompt_tokens, sum(len(t) for t in toks)), toks


def engine_single_stream(llm, SamplingParams):
    _engine_generate(llm, SamplingParams, warmup_prompts(1), [4])
    sws = []
    for r in range(REPEATS):
        prompt = random_prompt(SINGLE_PROMPT_LEN, seed=100 + r)  # fresh prompt each run: no prefix-cache hits
        sws.append(_engine_generate(llm, SamplingParams, [prompt], [SINGLE_NEW_TOKENS])[0])
    return rate_summary(SINGLE_NEW_TOKENS, sws)


def engine_prefill(llm, SamplingParams):
    _engine_generate(llm, SamplingParams, warmup_prompts(1), [1])
    sws = []
    for r in range(REPEATS):
        prompt = random_prompt(PREFILL_LEN, seed=200 + r)
        sws.append(_engine_generate(llm, SamplingParams, [prompt], [1])[0])
    return rate_summary(PREFILL_LEN, sws)


def run_engine(wl: Workload, engine_args: dict, results: dict, errors: list) -> None:
    try:
        from engine import LLM, SamplingParams
    except Exception as e:  # engine not there / broken import
        errors.append(f"engine import failed: {e!r}")
        log(errors[-1])
        return

    def _new_llm(**overrides):
        args = dict(engine_args)
        args.update(overrides)
        t0 = time.perf_counter()
        llm = LLM(**args)
        log(f"engine LLM({', '.join(f'{k}={v!r}' for k, v in args.items())}) ready in {time.perf_counter() - t0:.1f}s")
        return llm

    # (a) continuous batching, plus single-stream and prefill on the same instance
    llm = None
    try:
        llm = _new_llm()
        log("engine continuous batching ...")
        res, toks = engine_workload(llm, SamplingParams, wl, "engine continuous")
        results["engine_continuous"] = res
        results["_engine_tokens"] = toks
        log(f"  {res.wall_s:.2f}s, {res.output_tps:.1f} out tok/s")
        log("engine single-stream decode ...")
        results["engine_single_stream"] = engine_single_stream(llm, SamplingParams)
        log(f"  median {results['engine_single_stream']['median']:.1f} tok/s")
        log("engine prefill ...")
        results["engine_prefill"] = engine_prefill(llm, SamplingParams)
        log(f"  median {results['engine_prefill']['median']:.1f} tok/s")
    except Exception as e:
        errors.append(f"engine continuous/single-stream/prefill failed: {e!r}")
        log(errors[-1])
        traceback.print_exc()
    # (b) static policy: the contract has no way to switch the policy of a live LLM, and reusing it would
    # also reuse its prefix cache, so build a second one (after releasing the first).
    del llm
    gc.collect()
    llm = None
    try:
        llm = _new_llm(policy="static")
        log("engine static policy ...")
        res, _ = engine_workload(llm, SamplingParams, wl, "engine static")
        results["engine_static"] = res
        log(f"  {res.wall_s:.2f}s, {res.output_tps:.1f} out tok/s")
    except Exception as e:
        errors.append(f"engine static failed: {e!r}")
        log(errors[-1])
        traceback.print_exc()
    del llm
    gc.collect()


# --------------------------------------------------------------------------------------------- #
# transformers side                                                                              #
# --------------------------------------------------------------------------------------------- #


def run_hf(wl: Workload, batch_sizes: list[int], cb_tokens: list[int], results: dict, errors: list) -> None:
    import torch  # noqa: F401

    from benchmarks import hf_baselines as hb

    hb._quiet_transformers()
    t0 = time.perf_counter()
    model, tok = hb.load_hf_model(default_model_path())
    log(f"transformers model loaded in {time.perf_counter() - t0:.1f}s")

    results["hf_static"] = []
    for bs in batch_sizes:
        try:
            log(f"HF static bs={bs} ...")
            r = hb.hf_static(model, tok, wl, bs)
            results["hf_static"].append(r)
            log(f"  {r.wall_s:.2f}s, {r.output_tps:.1f} out tok/s")
        except Exception as e:
            errors.append(f"HF static bs={bs} failed: {e!r}")
            log(errors[-1])
            traceback.print_exc()

    results["hf_continuous"] = []
    for mbt in cb_tokens:
        try:
            log(f"HF continuous max_batch_tokens={mbt} ...")
            r, toks = hb.hf_continuous(model, wl, mbt, return_tokens=True)
            results["hf_continuous"].append(r)
            results.setdefault("_hf_cb_tokens", toks)
            log(f"  {r.wall_s:.2f}s, {r.output_tps:.1f} out tok/s")
        except Exception as e:
            errors.append(f"HF continuous mbt={mbt} failed: {e!r}")
            log(errors[-1])
            traceback.print_exc()

    try:
        log("HF single-stream decode ...")
        results["hf_single_stream"] = hb.hf_single_stream_decode(
            model, tok.pad_token_id, SINGLE_PROMPT_LEN, SINGLE_NEW_TOKENS, REPEATS
        )
        log(f"  median {results['hf_single_stream']['median']:.1f} tok/s")
        log("HF prefill ...")
        results["hf_prefill"] = hb.hf_prefill(model, PREFILL_LEN, REPEATS)
        log(f"  median {results['hf_prefill']['median']:.1f} tok/s")
    except Exception as e:
        errors.append(f"HF single-stream/prefill failed: {e!r}")
        log(errors[-1])
        traceback.print_exc()
    del model
    gc.collect()


# --------------------------------------------------------------------------------------------- #
# reporting                                                                                      #
# --------------------------------------------------------------------------------------------- #


def _best(runs):
    runs = [r for r in runs or [] if r is not None]
    return max(runs, key=lambda r: r.output_tps) if runs else None


def _ratio(a, b):
    return a / b if a and b else None


def agreement(a: list[list[int]] | None, b: list[list[int]] | None):
    """Greedy-output agreement between two systems: (#identical, mean common-prefix fraction)."""
    if not a or not b or len(a) != len(b):
        return None
    same, frac = 0, []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        same += int(x == y)
        frac.append(n / max(1, max(len(x), len(y))))
    return same, sum(frac) / len(frac)


def build_report(wl: Workload, results: dict, errors: list, meta: dict) -> tuple[str, dict]:
    rows = []  # (system, wall, out tps, total tps, note, best-marker)
    best_static = _best(results.get("hf_static"))
    best_cb = _best(results.get("hf_continuous"))
    for key in ("engine_continuous", "engine_static"):
        r = results.get(key)
        if r is not None:
            rows.append((r, ""))
    for r in results.get("hf_static", []):
        rows.append((r, " (best)" if r is best_static and len(results["hf_static"]) > 1 else ""))
    for r in results.get("hf_continuous", []):
        rows.append((r, " (best)" if r is best_cb and len(results["hf_continuous"]) > 1 else ""))

    threads = meta["torch_threads"]
    lines = [
        f"Workload: {wl.describe()}; greedy, ignore_eos. torch threads: {threads}.",
        "",
        "| system | wall s | output tok/s | total tok/s | cpu util | others | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    util = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    for r, mark in rows:
        lines.append(f"| {r.name}{mark} | {r.wall_s:.2f} | {r.output_tps:.1f} | {r.total_tps:.1f} | "
                     f"{util(r.cpu_util)} | {util(r.others)} | {r.note} |")

    def _ss(key):
        return results.get(key) or {}

    ss = {k: _ss(k) for k in ("engine_single_stream", "hf_single_stream", "engine_prefill", "hf_prefill")}
    fmt = lambda v: f"{v:.1f}" if v else "n/a"  # noqa: E731
    runs = lambda v: ", ".join(f"{x:.1f}" for x in v.get("runs", []))  # noqa: E731
    utils = lambda v, k="cpu_util": ", ".join(util(x) for x in v.get(k, []))  # noqa: E731
    how = {
        "engine_single_stream": f"engine decode: {SINGLE_PROMPT_LEN}-tok prompt, {SINGLE_NEW_TOKENS} new tokens, "
                                "new tokens / wall of generate()",
        "hf_single_stream": "HF decode: model.generate, batch 1, greedy, default DynamicCache, sdpa; same measure",
        "engine_prefill": f"engine prefill: {PREFILL_LEN}-tok prompt, max_tokens=1, prompt tokens / wall",
        "hf_prefill": f"HF prefill: one forward, {PREFILL_LEN} tokens, use_cache, logits_to_keep=1",
    }
    lines += ["", "| single stream | tok/s (median of 3) | runs | cpu util | others |", "|---|---:|---|---|---|"]
    for k, v in ss.items():
        lines.append(f"| {how[k]} | {fmt(v.get('median'))} | {runs(v)} | {utils(v)} | {utils(v, 'others_cpu')} |")
    e_dec, h_dec = ss["engine_single_stream"].get("median"), ss["hf_single_stream"].get("median")
    e_pre, h_pre = ss["engine_prefill"].get("median"), ss["hf_prefill"].get("median")

    ec, es = results.get("engine_continuous"), results.get("engine_static")
    ratios = {
        "continuous / best HF static": _ratio(ec and ec.output_tps, best_static and best_static.output_tps),
        "continuous / best HF continuous": _ratio(ec and ec.output_tps, best_cb and best_cb.output_tps),
        "continuous / engine static": _ratio(ec and ec.output_tps, es and es.output_tps),
        "single-stream engine / HF decode": _ratio(e_dec, h_dec),
        "prefill engine / HF (info)": _ratio(e_pre, h_pre),
    }
    lines += ["", "| ratio (output tok/s) | value | target | met |", "|---|---:|---:|---|"]
    for k, v in ratios.items():
        t = TARGETS.get(k)
        val = f"{v:.2f}x" if v else "n/a"
        tgt = f">= {t}x" if t else "-"
        met = "-" if (t is None or v is None) else ("yes" if v >= t else "NO")
        lines.append(f"| {k} | {val} | {tgt} | {met} |")
    if best_static is not None:
        lines.append(f"\nbest HF static: {best_static.name}; best HF continuous: "
                     f"{best_cb.name if best_cb else 'n/a'}")

    mns = meta.get("engine_args", {}).get("max_num_seqs", 64)  # contract default
    if es is not None and mns >= len(wl):
        lines.append(f"note: max_num_seqs={mns} >= {len(wl)} requests, all arriving at t=0, so the engine's static "
                     "policy admits the whole workload as one batch and behaves like continuous batching; pass "
                     "e.g. --engine-arg max_num_seqs=16 for a static-vs-continuous contrast.")
    agr = agreement(results.get("_engine_tokens"), results.get("_hf_cb_tokens"))
    if agr is not None:
        lines.append(f"greedy agreement engine vs HF continuous: {agr[0]}/{len(wl)} identical, "
                     f"mean common-prefix fraction {agr[1]:.3f} (fp32 ties may legitimately diverge)")
    lines.append(f"cpu util = this process's CPU s / wall s while timed (at most {threads} with {threads} torch "
                 f"threads); others = cores used by other processes meanwhile ({os.cpu_count()} cores). "
                 "Low cpu util / high others = starved run, its timing is pessimistic.")
    if errors:
        lines += ["", "ERRORS:"] + [f"- {e}" for e in errors]

    js = {
        "meta": meta,
        "workload": {
            "num_requests": len(wl),
            "seed": wl.seed,
            "prompt_tokens": wl.num_prompt_tokens,
            "output_tokens": wl.num_output_tokens,
            "prompt_lens": [r.prompt_len for r in wl.requests],
            "output_lens": wl.output_lens,
        },
        "engine_continuous": ec.as_dict() if ec else None,
        "engine_static": es.as_dict() if es else None,
        "hf_static": [r.as_dict() for r in results.get("hf_static", [])],
        "hf_continuous": [r.as_dict() for r in results.get("hf_continuous", [])],
        "best_hf_static": best_static.name if best_static else None,
        "best_hf_continuous": best_cb.name if best_cb else None,
        "single_stream_decode_tok_per_s": {"engine": ss["engine_single_stream"] or None,
                                           "hf": ss["hf_single_stream"] or None},
        "prefill_tok_per_s": {"engine": ss["engine_prefill"] or None, "hf": ss["hf_prefill"] or None},
        "ratios": ratios,
        "targets": TARGETS,
        "greedy_agreement_engine_vs_hf_cb": list(agr) if agr else None,
        "errors": errors,
    }
    return "\n".join(lines), js


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 requests, one HF batch size / CB setting (smoke test)")
    ap.add_argument("--skip-hf", action="store_true", help="skip all transformers baselines")
    ap.add_argument("--skip-engine", action="store_true", help="skip the engine (develop the HF side)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to LLM(...) (repeatable; values parsed as Python literals)")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (16 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for the whole run (engine and transformers alike); default: "
                         "torch's default. On an oversubscribed machine 1 thread is far more robust: with 2 "
                         "threads and another busy process, decode was measured 15-25x slower")
    ap.add_argument("--quiet-wait", type=float, default=120.0, metavar="SECONDS",
                    help="before each timed section wait up to this long for other processes to use < 0.5 "
                         "cores (shared machines; 0 disables)")
    ap.add_argument("--hf-batch-sizes", type=str, default=None, help="comma list, default 8,16,32 (8 with --quick)")
    ap.add_argument("--hf-cb-tokens", type=str, default=None,
                    help="comma list of max_batch_tokens for HF continuous batching, default 256,512,1024,2048 "
                         "(256 with --quick)")
    args = ap.parse_args(argv)

    engine_args = parse_engine_args(args.engine_arg)
    QUIET_WAIT.update(max_wait_s=args.quiet_wait, log=log)
    n = args.num_requests or (16 if args.quick else 64)
    batch_sizes = [int(x) for x in (args.hf_batch_sizes or ("8" if args.quick else "8,16,32")).split(",")]
    cb_tokens = [int(x) for x in (args.hf_cb_tokens or ("256" if args.quick else "256,512,1024,2048")).split(",")]

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)

    wl = make_workload(num_requests=n, seed=args.seed)
    meta = {
        "model_path": default_model_path(),
        "dtype": "float32",
        "device": "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "engine_args": engine_args,
        "hf_batch_sizes": batch_sizes,
        "hf_cb_max_batch_tokens": cb_tokens,
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quiet_wait_s": args.quiet_wait,
    }
    log(f"workload: {wl.describe()}")
    results: dict = {}
    errors: list[str] = []
    t_all = time.perf_counter()
    if not args.skip_engine:
        run_engine(wl, engine_args, results, errors)
    if not args.skip_hf:
        run_hf(wl, batch_sizes, cb_tokens, results, errors)
    meta["total_benchmark_s"] = time.perf_counter() - t_all
    meta["torch_threads_end"] = torch.get_num_threads()  # in case the engine changed it

    text, js = build_report(wl, results, errors, meta)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(js, f, indent=2)
        log(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
