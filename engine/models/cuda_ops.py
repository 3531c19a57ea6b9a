"""Triton kernels for a 16-bit model's small per-token ops on CUDA: RMSNorm (alone, or with the
residual add before it) and the gated activation act(gate) * up (SwiGLU, GeGLU), each one kernel
where torch runs several, the experts of a mixture as one grouped matmul (a decode step of a
small model is bound by its kernel count, even inside a CUDA graph), and LoRA adapters' deltas for
a batch of rows each with its own adapter (engine/lora.py), two kernels for all rows. Each rounds where
transformers' order does: the residual sum is rounded to the model's dtype before it is
normalized; RMSNorm normalizes in float32, rounds to the model's dtype, then scales by the weight
(rounded again); the gated activation rounds act(gate) before multiplying by up. Loaded only where Triton is
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


@triton.jit
def _grouped_matmul(x_ptr, w_ptr, out_ptr, starts_ptr, stride_x, stride_we, stride_wn, stride_out, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [starts[e], starts[e + 1]) of x times expert e's weight (N, K)^T: program (e, m, n)
    takes the expert's m-th tile of rows and n-th tile of columns; a tile past its rows does nothing."""
    expert, tile_m, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.load(starts_ptr + expert + 1)
    first = tl.load(starts_ptr + expert) + tile_m * BLOCK_M
    if first < end:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        weights = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(weights + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee" if a.dtype == tl.float32 else "tf32")
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """x (R, K) with its rows grouped by expert, expert e's rows [starts[e], starts[e + 1]) (int32,
    E + 1, on the device: no count comes back to the host) times weight[e] (E, N, K)^T -> (R, N)."""
    rows, k = x.shape
    experts, n, _ = weight.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 64, 32
    grid = (experts, triton.cdiv(max(rows, 1), block_m), triton.cdiv(n, block_n))
    _grouped_matmul[grid](x, weight, out, starts, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), n, k,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
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


def gated(x: torch.Tensor, activation: int) -> torch.Tensor:
    """x = [gate | up] (T, 2n) -> act(gate) * up (T, n), act by its code in engine.models.linear.GATED_ACTIVATIONS."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _gated[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                ACTIVATION=activation, BLOCK=block)
    return out


@triton.jit
def _lora_shrink(x_ptr, a_ptr, slots_ptr, u_ptr, stride_x, stride_as, stride_ar, stride_u, R, K,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """u[row] = A[slot] x[row] for the row's adapter slot (none: -1, nothing done), in float32."""
    row, tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        rs = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rs < R
        acc = tl.zeros([BLOCK_R], tl.float32)
        weights = a_ptr + slot.to(tl.int64) * stride_as
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(weights + rs[:, None] * stride_ar + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
        tl.store(u_ptr + row * stride_u + rs, acc, mask=r_ok)


@triton.jit
def _lora_expand(u_ptr, bt_ptr, slots_ptr, y_ptr, stride_u, stride_bs, stride_br, stride_y, R, N,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[row] += u[row] B^T[slot] (B^T scaled, (R, N)) for the row's adapter slot, summed in float32."""
    row, tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        ns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        weights = bt_ptr + slot.to(tl.int64) * stride_bs
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_ok = rs < R
            u = tl.load(u_ptr + row * stride_u + rs, mask=r_ok, other=0.0)
            b = tl.load(weights + rs[:, None] * stride_br + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(u[:, None] * b, 0)
        y = tl.load(y_ptr + row * stride_y + ns, mask=n_ok, other=0.0)
        tl.store(y_ptr + row * stride_y + ns, (y.to(tl.float32) + acc).to(y.dtype), mask=n_ok)


def lora_add(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    """y (T, N) += B (A x) of each row's LoRA adapter, in place: slots (T) int64 on the device (-1:
    none), a (S, R, K) and bt (S, R, N) the slots' A and scaled B^T stacked (zero past an
    adapter's rank and outside the outputs it writes); the products in float32 (Punica's BGMV
    shrink, then expand)."""
    rows, k = x.shape
    _, rank, n = bt.shape
    u = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(rank))
    _lora_shrink[(rows, triton.cdiv(rank, block_r))](x, a, slots, u, x.stride(0), a.stride(0), a.stride(1),
                                                     u.stride(0), rank, k, BLOCK_R=block_r, BLOCK_K=64)
    _lora_expand[(rows, triton.cdiv(n, 128))](u, bt, slots, y, u.stride(0), bt.stride(0), bt.stride(1), y.stride(0),
                                              rank, n, BLOCK_R=block_r, BLOCK_N=128)
