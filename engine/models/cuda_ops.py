"""Triton kernels for a 16-bit model's small per-token ops on CUDA: RMSNorm (alone, or with the
residual add before it) and SwiGLU, each one kernel where torch runs several (a decode step of a
small model is bound by its kernel count, even inside a CUDA graph). Each rounds where
transformers' order does: the residual sum is rounded to the model's dtype before it is
normalized; RMSNorm normalizes in float32, rounds to the model's dtype, then scales by the weight
(rounded again); SwiGLU rounds silu(gate) before multiplying by up. Loaded only where Triton is
(CUDA builds of torch ship it).

And the matmul of a few rows (`gemv`: a decode step of a few requests), which reads the weights
once at close to the memory's bandwidth where cuBLAS's kernels for so few rows read well below it
(BENCHMARKS.md). It can take the SwiGLU as its prologue, so the MLP's down projection reads
[gate | up] itself.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.config import MAX_GEMV_ROWS


@triton.jit
def _normalized(x, w_ptr, cols, ok, n, eps):
    """RMSNorm of one row x (float32) times the weight, in float32 (the caller rounds)."""
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    return normed.to(w.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    out = _normalized(x, w_ptr, cols, ok, n, eps)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, stride_sum, stride_out, n, eps,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    residual = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # as torch adds 16-bit tensors
    tl.store(sum_ptr + row * stride_sum + cols, total, mask=ok)
    out = _normalized(total.to(tl.float32), w_ptr, cols, ok, n, eps)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_x, stride_w, stride_out, num_rows,
          ROWS: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """out[r, BLOCK_N columns] = x[r] . w[column] (+ bias) for every row r < num_rows, x = silu(gate) * up
    of [gate | up] with SWIGLU. Products are summed in float32 across the K loop per lane, then once
    across the block: the order depends on BLOCK_K and the layout alone, not on which program runs."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    ok_n = cols < N
    ok_rows = rows < num_rows
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ok_k = ks < K if not EVEN_K else ks >= 0
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=ok_n[:, None] & ok_k[None, :], other=0.0)
        at = x_ptr + rows[:, None] * stride_x + ks[None, :]
        ok_x = ok_rows[:, None] & ok_k[None, :]
        if SWIGLU:  # as _swiglu rounds: silu(gate) to the dtype, then the product
            gate = tl.load(at, mask=ok_x, other=0.0).to(tl.float32)
            up = tl.load(at + K, mask=ok_x, other=0.0)
            x = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        else:
            x = tl.load(at, mask=ok_x, other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok_rows[:, None] & ok_n[None, :])


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(n: int, k: int, multiprocessors: int) -> dict:
    """Tile and launch settings of `gemv` for a (n, k) weight: narrow column tiles where wide ones
    would leave multiprocessors idle."""
    block_n = 16 if n // 16 >= 2 * multiprocessors else 8
    return dict(BLOCK_N=block_n, BLOCK_K=min(256, triton.next_power_of_2(k)), num_warps=4, num_stages=3)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
         config: dict | None = None) -> torch.Tensor:
    """x (T <= MAX_GEMV_ROWS, K) (or [gate | up] (T, 2K) with swiglu) times weight (N, K) transposed, plus
    bias: (T, N) in x's dtype. `config`: gemv_config's settings, for benchmarks to sweep."""
    rows, (n, k) = x.shape[0], weight.shape
    assert rows <= MAX_GEMV_ROWS and x.shape[1] == (2 * k if swiglu else k) and weight.stride(1) == 1, (
        x.shape, weight.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    config = config or gemv_config(n, k, _multiprocessors(x.device))
    _gemv[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        rows, ROWS=triton.next_power_of_2(rows), SWIGLU=swiglu, HAS_BIAS=bias is not None,
        EVEN_K=k % config["BLOCK_K"] == 0, **config)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, n) -> (T, n), in x's dtype."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), n, eps, BLOCK=triton.next_power_of_2(n))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm of it), both (T, n) in x's dtype: the residual add that ends one block
    of a layer done by the norm that starts the next."""
    total, out = torch.empty_like(x), torch.empty_like(x)
    n = x.shape[-1]
    _add_rms_norm[(x.shape[0],)](x, residual, weight, total, out, x.stride(0), residual.stride(0), total.stride(0),
                                 out.stride(0), n, eps, BLOCK=triton.next_power_of_2(n))
    return total, out


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] (T, 2n) -> silu(gate) * up (T, n)."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _swiglu[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
