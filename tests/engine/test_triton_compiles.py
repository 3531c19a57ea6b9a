"""Every Triton kernel compiles for the data-center GPUs users run (A100, H100, B200) where there is
no GPU: Triton's own compiler (its frontend, MLIR passes and the ptxas it ships) takes each kernel
to PTX and a cubin for each one's architecture, with the argument types and constants its launch
gives it. The interpreter (test_triton_interpreted.py) checks what the kernels compute but runs
their Python, so an error only the compiler sees would otherwise wait for a GPU."""
from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.attention import triton_paged
from engine.models import cuda_ops

GPUS = {"A100": 80, "H100": 90, "B200": 100}  # compute capability


@pytest.fixture(autouse=True)
def _fp_fusion_as_on_gpus(monkeypatch):
    """Fused multiply-adds, Triton's default on the GPU builds torch ships (newer Triton warns
    that its default will change)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
INDEX_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "tile_seq_ptr", "tile_start_ptr",
                  "slot_ptr"}
FLOAT32_POINTERS = {"acc_ptr", "ml_ptr"}  # a split decode's partial results


def compile_for(gpu: str, kernel, dtype: str, constants: dict):
    """`kernel` compiled for `gpu` with its tensors in `dtype` (Triton's name: bf16, fp16, fp32),
    int32 indices and partial results in float32, `scale` and `eps` float32, other integers int32;
    checks that the PTX is that GPU's."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INDEX_POINTERS else "*fp32" if name in FLOAT32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "fp32" if name in ("scale", "eps") else "i32"
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", GPUS[gpu], 32))
    assert f".target sm_{GPUS[gpu]}" in compiled.asm["ptx"] and compiled.asm["cubin"], kernel.fn.__name__


def _attention(block_size: int, group: int, head_dim: int, precision: str) -> dict:
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_N=max(triton_paged.KEY_TILE, block_size), BLOCK_SIZE=block_size, PRECISION=precision)


@pytest.mark.parametrize("gpu,dtype,precision", [("A100", "bf16", "tf32"), ("H100", "bf16", "tf32"),
                                                 ("H100", "fp32", "ieee"), ("B200", "bf16", "tf32")])
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 4, 64), (4, 3, 128)])
def test_the_attention_kernels_compile(gpu, dtype, precision, block_size, group, head_dim):
    common = _attention(block_size, group, head_dim, precision)
    block_q = triton_paged.PREFILL_QUERIES
    kernels = [
        (triton_paged._paged_attention,
         common | dict(BLOCK_Q=block_q, BLOCK_M=max(16, triton.next_power_of_2(block_q * group)))),
        (triton_paged._decode_partitions,
         common | dict(BLOCK_M=max(16, triton.next_power_of_2(group)), PARTITION=64)),
        (triton_paged._merge_partitions, dict(HEAD_DIM=head_dim, BLOCK_D=common["BLOCK_D"], PARTITION=64)),
        (triton_paged._rope_and_write,
         dict(NUM_HEADS=group * 2, NUM_KV_HEADS=2, HEAD_DIM=head_dim, BLOCK_D=common["BLOCK_D"])),
    ]
    for kernel, constants in kernels:
        compile_for(gpu, kernel, dtype, constants)


@pytest.mark.parametrize("gpu,dtype", [("A100", "bf16"), ("H100", "bf16"), ("H100", "fp16"), ("B200", "bf16")])
def test_the_fused_kernels_compile(gpu, dtype):
    for kernel in (cuda_ops._rms_norm, cuda_ops._add_rms_norm, cuda_ops._gated):
        compile_for(gpu, kernel, dtype, dict(BLOCK=1024))
