"""Triton kernels for a 16-bit model's small per-token ops on CUDA: RMSNorm (alone, or with the
residual add before it) and the gated activation act(gate) * up (SwiGLU, GeGLU), each one kernel where torch runs several (a decode step of a
small model is bound by its kernel count, even inside a CUDA graph). Each rounds where
transformers' order does: the residual sum is rounded to the model's dtype before it is
normalized; RMSNorm normalizes in float32, rounds to the model's dtype, then scales by the weight
(rounded again); the gated activation rounds act(gate) before multiplying by up. Loaded only where Triton is
(CUDA builds of torch ship it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.models.linear import GATED_ACTIVATIONS


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
def _gated(x_ptr, out_ptr, stride_x, stride_out, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """act(gate) * up; ACTIVATION: engine.models.linear.GATED_ACTIVATIONS' code (1 silu, 2 gelu tanh, 3 gelu)."""
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    if ACTIVATION == 1:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 2:  # tanh as 1 - 2 / (e^2x + 1)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    act = act.to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


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


def gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    """x = [gate | up] (T, 2n) -> act(gate) * up (T, n), act one of GATED_ACTIVATIONS."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _gated[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                ACTIVATION=GATED_ACTIVATIONS[activation], BLOCK=block)
    return out
