"""The CUDA kernels (engine/attention/triton_paged.py, engine/models/cuda_ops.py) run by Triton's
interpreter on the CPU, for tests/engine/test_triton_interpreted.py. Run as `TRITON_INTERPRET=1
python -m tests.engine.interpreted_kernels`: the interpreter is chosen when the kernels are
defined, so it needs a process of its own. Prints one JSON object: per case, each request's
attention error against float32 attention (also within sliding windows, with soft-capped
scores); a mixture of experts' grouped matmuls against its loop; whether a decode's output depends on how many
programs share its partitions; and per dtype, what failed in the fused kernels' check (null: it
passed)."""
from __future__ import annotations

import json
import os

import torch

import engine.attention.triton_paged as triton_paged
from engine.attention.base import AttentionParams
from tests.engine.helpers import (
    attention_case,
    check_fused_kernels,
    decode_outputs_however_split,
    expected_attention,
    run_attention,
)

CPU = torch.device("cpu")
SHAPES = [(13, 1), (2, 1), (300, 1), (77, 1), (0, 90), (40, 70), (200, 17)]  # (cached context, new tokens)


def errors(dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int, window: int | None = None,
           softcap: float | None = None) -> list[float]:
    """Each request's relative error against float32 attention (inputs rounded to `dtype`), within
    `window` (the blocks before a request's window are NaNs: read, the error is NaN) and with
    scores soft-capped by `softcap`."""
    case = attention_case(block_size + heads, SHAPES, block_size, heads, kv_heads, head_dim, CPU, window=window)
    backend = triton_paged.TritonPagedBackend(AttentionParams(case.scale, softcap), max_model_len=2048)
    out = run_attention(backend, case, dtype, CPU)
    return [((out[rows] - expected).norm() / expected.norm()).item()
            for rows, expected in expected_attention(case, dtype, softcap)]


def decodes_agree_however_split() -> bool:
    """Whether a batch of decodes, long contexts among them, gives the same bits however its
    partitions are shared out."""
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 64
    case = attention_case(0, [(700, 1), (63, 1), (64, 1), (5, 1)], block_size, heads, kv_heads, head_dim, CPU)
    backend = triton_paged.TritonPagedBackend(AttentionParams(case.scale), max_model_len=4096)
    cache = backend.allocate_kv_cache(1, case.num_blocks, block_size, kv_heads, head_dim, torch.float16, CPU)[0]
    cache.normal_(generator=torch.Generator().manual_seed(1))
    q, k, v = case.q.half(), case.keys[0][:4].half(), case.values[0][:4].half()  # a new key and value per decode
    metadata = backend.build_metadata(case.inputs)[0]
    outputs = decode_outputs_however_split(backend, q, k, v, cache, metadata)
    return metadata.decodes.parts > 1 and all(torch.equal(out, outputs[0]) for out in outputs[1:])


def grouped_experts_error(dtype: torch.dtype) -> float:
    """A mixture of experts (a shared one too) through the grouped matmuls against its per-expert
    loop, in `dtype`: the relative error of the output."""
    from engine.models import cuda_ops
    from engine.models.mlp import Experts, GatedMLP

    gen = torch.Generator().manual_seed(7)
    hidden, inter, num_experts = 64, 48, 4

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    shared = GatedMLP(w(2 * 32, hidden), w(hidden, 32), "silu")
    experts = Experts(w(num_experts, hidden), w(num_experts, 2 * inter, hidden), w(num_experts, hidden, inter),
                      "gelu_tanh", 2, True, shared, w(1, hidden)).to(dtype)
    x = torch.randn(37, hidden, generator=gen).to(dtype)
    want = experts(x).float()
    got = experts.forward_grouped(x, cuda_ops).float()
    return ((got - want).norm() / want.norm()).item()


def lora_error(dtype: torch.dtype) -> float:
    """Rows of three LoRA adapters (ranks 8, 16 and 4; a fused q/k/v's three parts, one part, two)
    and rows of none, through the Triton kernels over stacked slots against torch's grouped
    products: the relative error of the deltas."""
    from engine.lora import LoraMatmul, StackedLoraSlots

    gen = torch.Generator().manual_seed(11)
    k, n = 96, 160  # parts of 64, 48, 48 output columns
    parts = [(0, 64), (64, 48), (112, 48)]
    matmuls = {}
    for slot, (rank, chosen) in enumerate([(8, [0, 1, 2]), (16, [1]), (4, [0, 2])]):
        segments = tuple((j * rank, rank, *parts[p]) for j, p in enumerate(chosen))
        matmuls[slot] = LoraMatmul(torch.randn(rank * len(chosen), k, generator=gen) * 0.1, segments,
                                   tuple(torch.randn(rank, parts[p][1], generator=gen) * 0.1 for p in chosen))
    stacked = StackedLoraSlots(4, CPU, dtype)
    for slot, m in matmuls.items():
        stacked.set(slot, 0, 0, m.a, list(m.b), torch.tensor(m.segments), n)
    slots = torch.tensor([0, -1, 2, 1, 0, -1, 2, 2, 1])
    x = torch.randn(len(slots), k, generator=gen)
    want = torch.zeros(len(slots), n)
    for slot, m in matmuls.items():
        m.add(x, want, (slots == slot).nonzero().flatten())
    got = torch.zeros(len(slots), n, dtype=dtype)
    stacked.add(0, 0, x.to(dtype), got, slots)
    return ((got.float() - want).norm() / want.norm()).item()


def fused_kernels_failure(dtype: torch.dtype) -> str | None:
    """What the fused kernels' check (RMSNorm, SwiGLU, RoPE with the KV write) found, if anything."""
    try:
        check_fused_kernels(CPU, dtype)
    except AssertionError as e:
        return str(e)[:2000] or "assertion failed"
    return None


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    triton_paged._multiprocessors = lambda device: 8  # a CUDA device's property; the CPU has none
    cases = {f"{dtype}-block{block_size}-{heads}x{kv_heads}x{head_dim}":
             errors(getattr(torch, dtype), block_size, heads, kv_heads, head_dim)
             for dtype in ("float32", "float16") for block_size in (4, 16)
             for heads, kv_heads, head_dim in ((4, 4, 64), (9, 3, 64), (8, 2, 128))}
    windowed = {f"{dtype}-window{window}-softcap{softcap}":
                errors(getattr(torch, dtype), 16, 9, 3, 64, window, softcap)
                for dtype in ("float32", "float16") for window in (None, 24, 70) for softcap in (None, 5.0)
                if window or softcap}
    print(json.dumps({"errors": cases, "windowed": windowed,
                      "grouped_experts": {dtype: grouped_experts_error(getattr(torch, dtype))
                                          for dtype in ("float32", "float16")},
                      "lora": {dtype: lora_error(getattr(torch, dtype)) for dtype in ("float32", "float16")},
                      "decodes_agree_however_split": decodes_agree_however_split(),
                      "fused_kernels": {dtype: fused_kernels_failure(getattr(torch, dtype))
                                        for dtype in ("float32", "float16")}}))


if __name__ == "__main__":
    main()
