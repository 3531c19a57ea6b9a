"""The engine on one NVIDIA GPU: dtype and attention backend side by side, with transformers'
own single-stream decode as the baseline in the same run.

A randomly initialised model with SmolLM2-135M's shapes (30 layers, hidden 576, 9 query and 3 KV
heads of 64, vocab 49152) is built locally (no download); random weights change no timing. For
each configuration: the 64-request mixed workload (prompts 16-512, outputs 8-256, greedy,
ignore_eos) in output tokens/s, and single-stream decode (128-token prompt, 128 new tokens) in
tokens/s; medians of --repeats runs after a warm-up.

    python benchmarks/cuda_engine.py [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workload import make_workload, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

CONFIGS = [("float32", "torch"), ("bfloat16", "torch"), ("bfloat16", "flash")]
ENGINE_ARGS = dict(max_num_seqs=256, max_num_batched_tokens=4096, kv_cache_memory_bytes=8 << 30,
                   enable_prefix_caching=False)  # repeats must not reuse the previous run's prefills
SINGLE_PROMPT, SINGLE_NEW = 128, 128


def smollm2_shaped_model(path: str) -> str:
    vocab = 49152
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(vocab)}, unk_token="t0")), eos_token="t0")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                 tie_word_embeddings=True, eos_token_id=0)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_engine(model: str, dtype: str, backend: str, repeats: int) -> dict:
    llm = LLM(model, device="cuda", dtype=dtype, attention_backend=backend, **ENGINE_ARGS)
    workload = make_workload(64)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    single = SamplingParams(max_tokens=SINGLE_NEW, temperature=0, ignore_eos=True)
    llm.generate(workload.prompts[:4], params[:4], use_tqdm=False)  # warm-up
    mixed = [_timed(lambda: llm.generate(workload.prompts, params, use_tqdm=False)) for _ in range(repeats)]
    decode = [_timed(lambda s=s: llm.generate([random_prompt(SINGLE_PROMPT, seed=s)], single, use_tqdm=False))
              for s in range(repeats)]
    return {"mixed_output_tok_s": workload.num_output_tokens / statistics.median(mixed),
            "single_stream_tok_s": SINGLE_NEW / statistics.median(decode)}


def bench_transformers(model: str, repeats: int) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda").eval()

    def once(seed):
        ids = torch.tensor([random_prompt(SINGLE_PROMPT, seed=seed)], device="cuda")
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SINGLE_NEW, min_new_tokens=SINGLE_NEW,
                    do_sample=False, pad_token_id=0)

    once(99)
    return {"single_stream_tok_s": SINGLE_NEW / statistics.median(_timed(lambda s=s: once(s)) for s in range(repeats))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = smollm2_shaped_model(tmp)
        results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "transformers_bf16": bench_transformers(model, args.repeats)}
        for dtype, backend in CONFIGS:
            results[f"{dtype}/{backend}"] = bench_engine(model, dtype, backend, args.repeats)
    base = results["transformers_bf16"]["single_stream_tok_s"]
    print(f"{results['device']}, torch {results['torch']}; transformers bf16 single stream {base:.1f} tok/s")
    print(f"{'engine':<18}{'64-req mixed tok/s':>20}{'single stream tok/s':>21}{'vs transformers':>17}")
    for dtype, backend in CONFIGS:
        r = results[f"{dtype}/{backend}"]
        print(f"{dtype + '/' + backend:<18}{r['mixed_output_tok_s']:>20.0f}{r['single_stream_tok_s']:>21.1f}"
              f"{r['single_stream_tok_s'] / base:>16.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
