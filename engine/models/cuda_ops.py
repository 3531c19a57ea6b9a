"""Triton kernels for a 16-bit model's small per-token ops on CUDA: RMSNorm (alone, or with the
residual add before it) and SwiGLU, each one kernel where torch runs several (a decode step of a
small model is bound by its kernel count, even inside a CUDA graph). Each rounds where
transformers' order does: the residual sum is rounded to the model's dtype before it is
normalized; RMSNorm normalizes in float32, rounds to the model's dtype, then scales by the weight
(rounded again); SwiGLU rounds silu(gate) before multiplying by up. Loaded only where Triton is
(CUDA builds of torch ship it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
