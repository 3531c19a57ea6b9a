"""The GGUF block types the kernels run, each read three ways from the blocks a file stores:

- `dequantize`: the fp32 weights, the same bits as gguf's own dequantize (the same fp32 operations
  in the same order), for the fp32 GEMM path and as the reference the kernels are tested against;
- `block_integers`: each block of 32 weights as integers q and fp32 `d` (and an offset `m`) with
  w = d * q (+ m) exactly, as the large-batch GEMMs read them (engine/csrc/vector_gemm.cpp,
  block_quant_gemm.cpp): int8 where every q fits (int16 for Q6_K, whose 16-weight sub-scales are
  folded into q);
- `kernel_rows`: each weight row as the decode kernel reads it (engine/csrc/block_quant_linear.cpp,
  gguf_rows.cpp): Q8_0 and Q4_1 regrouped (a row's quantized values, then its scales, then its
  offsets), the other types as stored.

The types and their blocks (ggml's layouts; K-quants are super-blocks of 256 weights in 8
sub-blocks of 32, except Q6_K's 16 of 16):
  Q8_0   d, q[32] int8                        w = d * q
  Q4_0   d, nibbles[16]                       w = d * (q - 8)
  Q4_1   d, m, nibbles[16]                    w = d * q + m
  Q5_0   d, high bits[4], nibbles[16]         w = d * (q - 16)
  Q5_1   d, m, high bits[4], nibbles[16]      w = d * q + m
  Q4_K   d, dmin, 6-bit scales[12], nibbles[128]                w = (d * sc) * q - dmin * mn
  Q5_K   d, dmin, 6-bit scales[12], high bits[32], nibbles[128] w = (d * sc) * q - dmin * mn
  Q6_K   low nibbles[128], high pairs[64], int8 scales[16], d   w = (d * sc) * (q - 32)
  IQ4_XS d, high scale bits (2 bytes), low scale nibbles[4], nibbles[128]
                                              w = (d * (ls - 32)) * table[q]
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL

T = GGMLQuantizationType
BLOCK = 32
# the decode kernel's format codes (engine/csrc/kernels.h); 2 is Q8_0 times bf16 activations (the `int8` mode's)
KERNEL_FORMATS = {T.Q8_0: 0, T.Q4_1: 1, T.Q4_0: 3, T.Q5_0: 4, T.Q5_1: 5, T.Q4_K: 6, T.Q5_K: 7, T.Q6_K: 8,
                  T.IQ4_XS: 9}
SUPER_BLOCK = {T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS}  # 256 weights a block; the rest 32
_IQ4_TABLE = torch.tensor(IQ4_NL.kvalues, dtype=torch.int16)


def runs(qtype: GGMLQuantizationType, columns: int) -> bool:
    """Whether the kernels run rows of `columns` weights in `qtype` blocks."""
    return qtype in KERNEL_FORMATS and columns % GGML_QUANT_SIZES[qtype][0] == 0


def _blocks(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """(N, row bytes) uint8 -> (N, blocks a row, block bytes) uint8 (a copy of a read-only source, such
    as a file mapped from disk: torch takes only writable arrays)."""
    rows = blocks.shape[0]
    writable = np.require(blocks, requirements=["C_CONTIGUOUS", "WRITEABLE"])
    return torch.from_numpy(writable).view(rows, -1, GGML_QUANT_SIZES[qtype][1])


def _half(b: torch.Tensor) -> torch.Tensor:
    """fp16 values in bytes (..., 2) as fp32."""
    return b.contiguous().view(torch.float16).float()[..., 0]


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n) -> their low nibbles then their high ones (..., 2n): ggml's order of 4-bit values."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins (..., 12) -> (..., 8) each."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of little-endian bytes qh (..., count / 8) for i < count, as (..., count) uint8."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], count)


def parts(blocks: np.ndarray, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weights as (q, d, m) per block of 32: q (N, K / 32, 32) int16, d and m (N, K / 32)
    fp32 with w = d * q (+ m) computed as gguf computes it (m None: no offset). Q6_K's q are its
    q - 32 with the sub-block's scale d * sc as d over 16 weights: (N, K / 16, 16)."""
    if qtype not in KERNEL_FORMATS:
        raise ValueError(f"the kernels do not run {qtype.name} blocks")
    b = _blocks(blocks, qtype)
    rows = b.shape[0]
    if qtype == T.Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int16), _half(b[..., 0:2]), None
    if qtype == T.Q4_0:
        return _nibbles(b[..., 2:]).to(torch.int16) - 8, _half(b[..., 0:2]), None
    if qtype == T.Q4_1:
        return _nibbles(b[..., 4:]).to(torch.int16), _half(b[..., 0:2]), _half(b[..., 2:4])
    if qtype in (T.Q5_0, T.Q5_1):
        start = 4 if qtype == T.Q5_1 else 2  # the high bits, after the scale (and the Q5_1 minimum)
        high = _high_bits(b[..., start:start + 4], 32)
        q = (_nibbles(b[..., start + 4:]) | (high << 4)).to(torch.int16)
        if qtype == T.Q5_0:
            return q - 16, _half(b[..., 0:2]), None
        return q, _half(b[..., 0:2]), _half(b[..., 2:4])
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        if qtype == T.Q4_K:
            q = _nibbles(b[..., 16:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 4, 2, 32)
        else:
            high = ((b[..., 16:48][..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1)  # (.., 8, 32)
            low = _nibbles(b[..., 48:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 4, 2, 32)
            q = low | (high.reshape(rows, -1, 4, 2, 32) << 4)
        scale = (d[..., None] * sc.float()).reshape(rows, -1)
        offset = -(dmin[..., None] * mn.float()).reshape(rows, -1)
        return q.to(torch.int16).reshape(rows, -1, 32), scale, offset
    if qtype == T.Q6_K:
        ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _half(b[..., 208:210])
        low = _nibbles(ql.reshape(rows, -1, 2, 64)).reshape(rows, -1, 2, 2, 64)  # (.., half, nibble, 64)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
        high = ((qh.reshape(rows, -1, 2, 1, 32) >> shifts[:, None]) & 3).reshape(rows, -1, 2, 2, 64)
        q = (low | (high << 4)).to(torch.int16) - 32
        scale = (d[..., None] * sc.contiguous().view(torch.int8).float()).reshape(rows, -1)
        return q.reshape(rows, -1, 16), scale, None
    # IQ4_XS
    d, scales_h = _half(b[..., 0:2]), b[..., 2:4].contiguous().view(torch.int16)[..., 0]
    low = _nibbles(b[..., 4:8])  # low nibbles of sub-blocks 0, 2, 4, 6, then of 1, 3, 5, 7
    low = torch.stack([low[..., :4], low[..., 4:]], dim=-1).reshape(rows, -1, 8)
    high = (scales_h[..., None].to(torch.int32) >> (2 * torch.arange(8))) & 3
    ls = (low.to(torch.int32) | (high << 4)) - 32
    q = _IQ4_TABLE[_nibbles(b[..., 8:].reshape(rows, -1, 8, 16)).long()]
    return q.reshape(rows, -1, 32), (d[..., None] * ls.float()).reshape(rows, -1), None


def dequantize(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF blocks (N, row bytes) as fp32 weights (N, K): gguf's dequantize, bit for bit."""
    q, d, m = parts(blocks, qtype)
    w = d[..., None] * q.float()
    if m is not None:
        w = w + m[..., None]
    return w.reshape(q.shape[0], -1)


def block_integers(blocks: np.ndarray, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor | None]:
    """The weights as integers per block of 32 for the large-batch GEMMs: q (N, K) (int8, or
    int16 for Q6_K: its sub-block scale's integer times q - 32, the block's d the file's d), and
    d, m (N, K / 32) fp32 with w = d * q (+ m)."""
    if qtype != T.Q6_K:
        q, d, m = parts(blocks, qtype)
        return q.reshape(q.shape[0], -1).to(torch.int8), d, m
    b = _blocks(blocks, qtype)
    rows = b.shape[0]
    q, _, _ = parts(blocks, qtype)  # (N, K / 16, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int16).reshape(rows, -1)
    integers = (q * sc[..., None]).reshape(rows, -1)
    d = _half(b[..., 208:210]).repeat_interleave(8, dim=-1)  # one d per 32 weights of a super-block
    return integers, d, None


_ROW_FIELDS = {T.Q8_0: (2, 32), T.Q4_1: (2, 2, 16)}  # a block's bytes in order, for the regrouped types


def kernel_rows(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """GGUF blocks (N, row bytes) as the decode kernel reads them, the same bytes per row: Q8_0
    and Q4_1 regrouped (the row's quantized values, then its fp16 scales, then (Q4_1) its fp16
    offsets, so the kernel loads a run of scales at once instead of one per block); the other
    types as stored (copied where the source is read-only, as a file mapped from disk is: the
    model's buffers are its own)."""
    fields = _ROW_FIELDS.get(qtype)
    if fields is None:
        return np.require(blocks, requirements=["C_CONTIGUOUS", "WRITEABLE"])
    per_block = blocks.reshape(blocks.shape[0], -1, sum(fields))
    starts = np.cumsum((0,) + fields)
    pieces = [per_block[:, :, start:start + size] for start, size in zip(starts, fields)]
    regrouped = pieces[-1:] + pieces[:-1]  # the quantized values first
    return np.ascontiguousarray(np.concatenate([p.reshape(blocks.shape[0], -1) for p in regrouped], axis=1))


def stored_blocks_of(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """kernel_rows undone: the GGUF blocks (N, row bytes)."""
    fields = _ROW_FIELDS.get(qtype)
    if fields is None:
        return rows
    count = rows.shape[0]
    per_row = rows.shape[1] // sum(fields)  # blocks in a row
    sizes = fields[-1:] + fields[:-1]  # as kernel_rows laid them out
    pieces = np.split(rows, np.cumsum([size * per_row for size in sizes])[:-1], axis=1)
    pieces = [piece.reshape(count, per_row, size) for piece, size in zip(pieces, sizes)]
    return np.concatenate(pieces[1:] + pieces[:1], axis=2).reshape(count, -1)
