"""A Llama-3.2-1B-shaped model in the GGUF types people download, beside llama.cpp's server on the
same files (CPU).

`make DIR --llama-cpp SRC --llama-quantize BIN`: the checkpoint (random weights, seed 0; Llama-3.2-1B's
shapes: 16 layers, hidden 2048, MLP 8192, 32 query and 8 KV heads of 64, tied embeddings; the
embedded SmolLM2 tokenizer, vocabulary 49,152) saved in bf16, converted by llama.cpp's
`convert_hf_to_gguf.py` (SRC: the llama.cpp tree vendored in the llama-cpp-python sdist; it imports
sentencepiece, in the `bench` extra) to F16,
and quantized by its `llama-quantize` (built out of tree from the same tree) to each type: Q4_K_M
(Q4_K, with Q6_K for attn_v and half of ffn_down), Q6_K, Q8_0. `--shapes 3b,8b`: Llama-3.2-3B and
Llama-3.1-8B shapes too (the same vocabulary), their F16 files written tensor by tensor by the gguf
package (no model in memory), quantized to Q4_K_M by llama-quantize.

`run DIR --types Q4_K_M,... [--llama-server BIN]`: per type, cbserve (`quantization: gguf`: random
weights give flat logits, which no quality check passes, so the mode is forced) and llama.cpp's
server (16 slots, 2 threads) in alternated rounds: single-stream decode (128-token prompt, 128
new), prefill of one 512-token prompt, the 64-request mixed workload (benchmarks/workload.py);
the memory-bandwidth limit of decode (the bytes of weights a decode step reads over the read
bandwidth measured in the same run) and the int8 compute limit of the workload (the model's
multiply-adds per token over the kernels' own rate on a 512-row batch, measured in the same run);
quality against the fp32 model dequantized from the same file, teacher-forced on the shipped text.

    .venv/bin/python benchmarks/gguf_1b.py make /tmp/b1b --llama-cpp SRC --llama-quantize BUILD/bin/llama-quantize \\
        [--shapes 3b,8b]
    .venv/bin/python benchmarks/gguf_1b.py run /tmp/b1b --types Q4_K_M,Q6_K,Q8_0 --repeats 3 \\
        --llama-server BUILD/bin/llama-server --json benchmarks/results/gguf_1b_<cpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import LlamaServer, bench_engine, cpu_features, prefill, single_stream, workload  # noqa: E402
from benchmarks.workload import Stopwatch  # noqa: E402
from engine import LLM  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402
from engine.quality import compare, eval_tokens, token_scores  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=True)
TYPES = ("Q4_K_M", "Q6_K", "Q8_0")


def make(directory: Path, llama_cpp: Path, llama_quantize: str, types: list[str]) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.model_loader import default_model_path

    hf = directory / "hf"
    if not (hf / "config.json").exists():
        embedded = default_model_path()
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(embedded), gguf_file=os.path.basename(embedded))
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, **SHAPE)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    f16 = directory / "model-F16.gguf"
    if not f16.exists():
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(f16),
                        "--outtype", "f16"], check=True)
    for qtype in types:
        out = directory / f"model-{qtype}.gguf"
        if not out.exists():
            subprocess.run([llama_quantize, str(f16), str(out), qtype, "2"], check=True)
        print(f"{out}: {out.stat().st_size / 1e6:.0f} MB")


# the larger shapes people serve on CPUs: (hidden, MLP, layers, query heads, KV heads, tied embeddings)
SHAPES = {"3b": (3072, 8192, 28, 24, 8, True), "8b": (4096, 14336, 32, 32, 8, False)}


def make_shaped(directory: Path, shape: str, llama_quantize: str, qtype: str = "Q4_K_M") -> Path:
    """A Llama-3.2-3B- or Llama-3.1-8B-shaped checkpoint (SHAPES; head dim 128, the 1B's vocabulary and
    tokenizer read from its F16 file made by `make`): an F16 GGUF written tensor by tensor with the gguf
    package's writer (random values, never the whole model in memory), quantized by llama-quantize."""
    import gguf
    import numpy as np

    out = directory / f"model-{shape}-{qtype}.gguf"
    if out.exists():
        return out
    hidden, mlp, layers, heads, kv_heads, tied = SHAPES[shape]
    source = gguf.GGUFReader(directory / "model-F16.gguf")
    fields = {name: source.fields[name].contents() for name in source.fields}
    vocab = len(fields["tokenizer.ggml.tokens"])
    f16 = directory / f"model-{shape}-F16.gguf"
    writer = gguf.GGUFWriter(f16, "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"])
    head = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (heads * head, hidden),
                   f"blk.{i}.attn_k.weight": (kv_heads * head, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * head, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, heads * head), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.ffn_gate.weight": (mlp, hidden), f"blk.{i}.ffn_up.weight": (mlp, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, mlp)}
    pool = (np.random.default_rng(0).standard_normal(1 << 24) * 0.02).astype(np.float16)

    def values(name: str, shape: tuple[int, ...], at: int) -> np.ndarray:
        if len(shape) == 1:  # a norm's weight
            return np.ones(shape, np.float32)
        count = int(np.prod(shape))
        return np.resize(np.roll(pool, at), count).reshape(shape)

    for name, shape in shapes.items():
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                               raw_dtype=gguf.GGMLQuantizationType.F32 if len(shape) == 1
                               else gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for at, (name, shape) in enumerate(shapes.items()):
        writer.write_tensor_data(values(name, shape, 7919 * at))
    writer.close()
    subprocess.run([llama_quantize, str(f16), str(out), qtype, "2"], check=True)
    f16.unlink()
    print(f"{out}: {out.stat().st_size / 1e6:.0f} MB")
    return out


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second the cores read (a 1 GiB sum, two threads): the median of `repeats`."""
    data = torch.ones(1 << 28)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(seconds)


def int8_rate(llm: LLM, rows: int = 512, repeats: int = 5) -> float:
    """Multiply-adds per second of the model's largest matmul (the MLP's gate/up) on a `rows`-row
    batch, through whichever batch kernel the engine runs it with."""
    matmul = max((m for m in llm.engine.loaded.model.modules() if isinstance(m, BlockQuantLinear)),
                 key=lambda m: m.weight_bytes)
    columns = sum(rows.shape[0] for rows in matmul.part_rows)
    x = torch.randn(rows, matmul.in_features)
    matmul(x)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x)
        seconds.append(time.perf_counter() - start)
    return rows * columns * x.shape[1] / statistics.median(seconds)


def model_multiply_adds(llm: LLM) -> int:
    """Multiply-adds one token costs in the model's matmuls (its parameters, the embedding lookup aside)."""
    return sum(sum(r.shape[0] for r in m.part_rows) * m.in_features
               for m in llm.engine.loaded.model.modules() if isinstance(m, BlockQuantLinear))


def quality(path: str, llm: LLM, num_tokens: int) -> dict:
    reference = LLM(path, quantization="none", enable_prefix_caching=False)
    ids = eval_tokens(reference.engine.tokenizer, num_tokens)
    scores = token_scores(reference.engine.loaded.model, ids)
    del reference
    return {margin: compare(scores, token_scores(llm.engine.loaded.model, ids), min_margin=margin).__dict__
            for margin in (0.0, 0.2)}


def run(directory: Path, types: list[str], repeats: int, llama_server: str | None, quality_tokens: int) -> dict:
    results = {"cpu": cpu_features(), "types": {}}
    print(results["cpu"])
    for qtype in types:
        path = str(directory / f"model-{qtype}.gguf")
        with Stopwatch() as start:
            llm = bench_engine("gguf", quality_tokens=0, model=path)
        server = LlamaServer(llama_server, path) if llama_server else None
        rounds = []
        for r in range(repeats):
            figures = {"read_bytes_per_s": read_bandwidth()}
            for name, measure in (("decode_tok_s", single_stream), ("prefill_tok_s", prefill),
                                  ("workload_tok_s", workload)):
                figures[name] = measure(llm)[0]
                if server is not None:
                    figures[f"llama_{name}"] = getattr(server, name.removesuffix("_tok_s").replace(
                        "decode", "single_stream"))()[0]
            figures["int8_multiply_adds_per_s"] = int8_rate(llm)
            rounds.append(figures)
            print(qtype, f"round {r + 1}:", {k: round(v, 1) if v < 1e6 else f"{v:.3g}" for k, v in figures.items()},
                  flush=True)
        if server is not None:
            server.close()
        medians = {k: statistics.median(f[k] for f in rounds) for k in rounds[0]}
        step_bytes = llm.engine.loaded.weight_bytes_per_token
        multiply_adds = model_multiply_adds(llm)
        entry = {"file_mb": os.path.getsize(path) / 1e6, "start_s": start.wall_s, "decode_step_mb": step_bytes / 1e6,
                 "medians": medians, "rounds": rounds,
                 "decode_bandwidth_limit_tok_s": medians["read_bytes_per_s"] / step_bytes,
                 "workload_compute_limit_tok_s": medians["int8_multiply_adds_per_s"] / multiply_adds}
        entry["decode_of_limit"] = medians["decode_tok_s"] / entry["decode_bandwidth_limit_tok_s"]
        entry["workload_of_limit"] = medians["workload_tok_s"] / entry["workload_compute_limit_tok_s"]
        if server is not None:
            for name in ("decode_tok_s", "prefill_tok_s", "workload_tok_s"):
                entry[f"{name.removesuffix('_tok_s')}_vs_llama"] = statistics.median(
                    f[name] / f[f"llama_{name}"] for f in rounds)
        if quality_tokens:
            entry["quality"] = quality(path, llm, quality_tokens)
        results["types"][qtype] = entry
        print(qtype, json.dumps({k: v for k, v in entry.items() if k != "rounds"}, indent=1), flush=True)
        del llm
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("make", "run"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--shapes", default="", help="make: also these larger shapes in Q4_K_M (3b, 8b)")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree (make)")
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary (make)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    types = args.types.split(",")
    args.directory.mkdir(parents=True, exist_ok=True)
    if args.command == "make":
        make(args.directory, args.llama_cpp, args.llama_quantize, types)
        for shape in filter(None, args.shapes.split(",")):
            make_shaped(args.directory, shape, args.llama_quantize)
        return
    results = run(args.directory, types, args.repeats, args.llama_server, args.quality_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
