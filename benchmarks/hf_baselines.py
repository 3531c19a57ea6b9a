"""transformers baselines for the throughput benchmark (static batching, continuous batching,
single-stream decode, prefill), all fp32 on CPU on the embedded SmolLM2-135M-Instruct GGUF.

Timing conventions (shared with the engine side in throughput.py):
  * every measurement is preceded by a small warm-up run;
  * "useful" output tokens = sum of each request's own requested output length (padding /
    over-generation in static batches is not counted);
  * total tokens = prompt tokens + useful output tokens.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from benchmarks.workload import (
    RunResult,
    Stopwatch,
    Workload,
    make_workload,
    random_prompt,
    rate_summary,
    warmup_prompts,
)


def load_hf_model(path: str):
    """Load model + tokenizer from the GGUF (dequantised to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return model, tok


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------- #
# (c) static batching with model.generate                                                        #
# --------------------------------------------------------------------------------------------- #


def _generate_padded(model, pad_id: int, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """Left-padded batched greedy generate of exactly `new_tokens` tokens; returns generated ids only."""
    max_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, max_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, max_len - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # emulates ignore_eos: EOS is masked until the end
            pad_token_id=pad_id,
        )
    return out[:, max_len:]


def hf_static(model, tok, wl: Workload, batch_size: int) -> RunResult:
    pad_id = tok.pad_token_id
    reqs = wl.requests
    # warm-up: one tiny batch
    _generate_padded(model, pad_id, warmup_prompts(), 4)
    useful = 0
    with Stopwatch() as sw:
        for s in range(0, len(reqs), batch_size):
            batch = reqs[s : s + batch_size]
            n = max(r.output_len for r in batch)
            gen = _generate_padded(model, pad_id, [r.prompt_token_ids for r in batch], n)
            if gen.shape[1] != n:
                raise RuntimeError(f"HF static generated {gen.shape[1]} tokens, expected {n}")
            useful += sum(r.output_len for r in batch)
    assert useful == wl.num_output_tokens
    return RunResult.from_stopwatch(f"HF static bs={batch_size}", sw, wl.num_prompt_tokens, useful)


# --------------------------------------------------------------------------------------------- #
# (d) continuous batching (transformers 5.x ContinuousBatchingManager)                          #
# --------------------------------------------------------------------------------------------- #


def _cb_run(manager, prompts: list[list[int]], out_lens: list[int], timeout_s: float) -> dict[str, list[int]]:
    """Submit all requests, wait for all of them; returns request_id -> generated tokens."""
    ids = []
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        rid = manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        if rid is None:
            raise RuntimeError("HF CB manager refused a request")
        ids.append(rid)
    results: dict[str, list[int]] = {}
    deadline = time.perf_counter() + timeout_s
    while len(results) < len(ids):
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("HF CB generation thread died")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"HF CB: only {len(results)}/{len(ids)} finished")
            continue
        if res.is_finished():
            if res.error is not None:
                raise RuntimeError(f"HF CB request {res.request_id} failed: {res.error}")
            results[res.request_id] = list(res.generated_tokens)
    return results


def hf_continuous(
    model,
    wl: Workload,
    max_batch_tokens: int,
    page_size: int = 256,
    timeout_s: float = 3600.0,
    return_tokens: bool = False,
):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    prompts, out_lens = wl.prompts, wl.output_lens
    max_seq = max(len(p) + n for p, n in zip(prompts, out_lens))
    # Enough KV for every request at once (+ slack), so HF never has to evict; sized explicitly
    # because the CPU auto-sizing would grab 60% of system RAM.
    blocks_per_req = -(-max_seq // page_size) + 1
    num_blocks = max(16, len(prompts) * blocks_per_req)
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(out_lens),
        eos_token_id=-1,  # ignore EOS (also passed per request)
        pad_token_id=model.generation_config.pad_token_id,
        bos_token_id=model.generation_config.bos_token_id,
    )
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=min(len(prompts), max_batch_tokens),
        allow_block_sharing=False,  # random prompts share nothing; keeps it a pure batching comparison
        auto_switch_to_flash=False,
        seed=0,
    )
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(out_lens),
                          num_requests=len(prompts))
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints, block=True, timeout=60
    ) as manager:
        # warm-up (small), inside the same manager so its setup is not timed
        _cb_run(manager, warmup_prompts(), [4, 4], timeout_s)
        with Stopwatch() as sw:
            results = _cb_run(manager, prompts, out_lens, timeout_s)
    got = 0
    for i, n in enumerate(out_lens):
        toks = results[f"r{i}"]
        if len(toks) != n:
            raise RuntimeError(f"HF CB request r{i} generated {len(toks)} tokens, expected {n}")
        got += len(toks)
    res = RunResult.from_stopwatch(f"HF continuous mbt={max_batch_tokens}", sw, wl.num_prompt_tokens, got,
                                   note=f"page_size={page_size}, num_blocks={num_blocks}")
    if return_tokens:
        return res, [results[f"r{i}"] for i in range(len(out_lens))]
    return res


# --------------------------------------------------------------------------------------------- #
# single stream decode / prefill                                                                 #
# --------------------------------------------------------------------------------------------- #


def hf_single_stream_decode(model, pad_id: int, prompt_len: int = 128, new_tokens: int = 128, repeats: int = 3):
    """model.generate, batch 1, greedy, DynamicCache (default), exactly `new_tokens` new tokens.

    tok/s = new_tokens / wall of the whole generate call (prefill of the prompt included, as for
    the engine side)."""
    _generate_padded(model, pad_id, warmup_prompts(1), 4)  # warm-up
    sws = []
    for r in range(repeats):
        prompt = random_prompt(prompt_len, seed=100 + r)  # same prompts as the engine side
        with Stopwatch() as sw:
            gen = _generate_padded(model, pad_id, [prompt], new_tokens)
        assert gen.shape[1] == new_tokens
        sws.append(sw)
    return rate_summary(new_tokens, sws)


def hf_prefill(model, prompt_len: int = 512, repeats: int = 3):
    """One forward over a `prompt_len`-token prompt (use_cache=True, logits only for the last
    position, as generate() does)."""
    with torch.inference_mode():
        warm = torch.tensor(warmup_prompts(1), dtype=torch.long)
        model(input_ids=warm, use_cache=True, logits_to_keep=1)  # warm-up
        sws = []
        for r in range(repeats):
            prompt = torch.tensor([random_prompt(prompt_len, seed=200 + r)], dtype=torch.long)
            with Stopwatch() as sw:
                model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            sws.append(sw)
    return rate_summary(prompt_len, sws)


if __name__ == "__main__":  # tiny self-check: python -m benchmarks.hf_baselines
    from benchmarks.workload import default_model_path

    _quiet_transformers()
    m, t = load_hf_model(default_model_path())
    w = make_workload(num_requests=4, prompt_len_range=(16, 64), output_len_range=(4, 16))
    print(w.describe())
    for r in (hf_static(m, t, w, 2), hf_continuous(m, w, 128)):
        print(r.as_dict())
