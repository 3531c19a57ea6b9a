"""The model's matmuls, one class per execution mode, chosen by `quantization` at load time, each
with the fusions a decoder layer needs: a prologue on its input (RMSNorm, or the gated activation
act(gate) * up of a fused gate/up output: SwiGLU, or GeGLU with GeLU's tanh or erf form) and a
residual added to its output. The fp32 reference runs them as separate torch
ops in transformers' order; the quantized decode kernel fuses them, so a decode step makes a few
calls per layer instead of a dozen small ops (per-op overhead, not arithmetic, dominates there).

`none`: fp32 weights, F.linear (the reference: exact parity with transformers). `gguf`: a GGUF
checkpoint's own blocks (Q4_1, Q8_0) as stored, so no re-quantization error
(engine/models/gguf_blocks.py), with activations quantized per block of 32 to 15 bits, so the
decode kernel takes integer dot products (engine/csrc/block_quant_linear.cpp) with 16-bit
products (madd) per block: 8-bit activations (llama.cpp's) lose top-1 agreement with fp32 where
15 bits lose none measurable (BENCHMARKS.md). `int8`: every matmul
re-quantized to GGUF's Q8_0 blocks (int8 weights, one scale per 32) with scales of at most 8
significant bits, and activations rounded to bf16: each weight d * q is then exactly two bf16
values and each product exact, so on AMX tiles large batches sum them over all of K without
leaving the tiles (engine/csrc/block_quant_gemm.cpp), where per-block scales cost a store and a
scaling every block; what the rounding costs in quality is in BENCHMARKS.md.

`w8a16` / `w4a16`: torch's weight-only kernels on bf16 activations, for CPUs with bf16 dot
products (AVX512-BF16, AMX); on AVX2 they beat fp32 only on a few rows (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn
from tqdm.auto import tqdm

from engine.config import QUANTIZATION_MODES
from engine.models import gguf_types
from engine.models.gguf_types import KERNEL_FORMATS

if TYPE_CHECKING:
    from engine.models.paged_model import PagedModel

logger = logging.getLogger(__name__)

BLOCK = 32  # values per quantization block, of weights and of activations
ACTIVATION_LEVELS = 127 * 128  # activations are integers in [-LEVELS, LEVELS] times a scale per block
BF16_Q8_0_FORMAT = 2  # the kernel's code for Q8_0 blocks times activations rounded to bf16
GATED_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2, "gelu": 3}  # act(gate) * up prologues, by the kernels' codes


@functools.cache
def triton_ops():
    """engine.models.cuda_ops where Triton imports, else None."""
    try:
        from engine.models import cuda_ops
    except ImportError:
        return None
    return cuda_ops


def fused_ops(x: torch.Tensor):
    """The Triton kernels (engine.models.cuda_ops) for a 16-bit CUDA tensor, where they load; None elsewhere."""
    return triton_ops() if x.is_cuda and x.dtype != torch.float32 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' order in 16-bit dtypes: normalize in float32, round, then scale (fused in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    if (ops := fused_ops(x)) is not None:
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype) * weight


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of x = [gate | up] (T, 2n) -> (T, n), act one of GATED_ACTIVATIONS."""
    if (ops := fused_ops(x)) is not None:
        return ops.gated(x, GATED_ACTIVATIONS[activation])
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate).mul_(up)
    if activation in ("gelu_tanh", "gelu"):
        return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none").mul_(up)
    raise ValueError(f"gated activation {activation!r}: one of {sorted(GATED_ACTIVATIONS)}")


def prologue(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None, gated: str | None) -> torch.Tensor:
    """RMSNorm with `norm` = (weight, eps), or act(gate) * up of x = [gate | up] with `gated` the
    activation, or x."""
    if norm is not None:
        return rms_norm(x, *norm)
    if gated is not None:
        return gated_activation(x, gated)
    return x


def _plus(residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    return out if residual is None else residual + out


class Linear(nn.Module):
    """residual + prologue(x) W^T + b in the model's dtype."""
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return _plus(residual, F.linear(prologue(x, norm, gated), self.weight, self.bias))

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 values of a row to steps of max|x| / ACTIVATION_LEVELS (15 bits):
    the values the kernel's integer dot products see (the same IEEE fp32 arithmetic, ties
    rounded to even)."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / ACTIVATION_LEVELS
    inverse = torch.where(scale != 0, 1 / scale, 0)
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def tile_order(values: torch.Tensor) -> torch.Tensor:
    """(N, K) values in AMX tile order (N / 16, K / 32, 512), TDPBF16PS's B operand: each 16
    columns' block as 16 rows holding each column's values 2r and 2r + 1."""
    rows, cols = values.shape
    tiles = values.reshape(rows // 16, 16, cols // BLOCK, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(rows // 16, cols // BLOCK, -1).contiguous()


def tile_blocks(parts: list[tuple[GGMLQuantizationType, np.ndarray]]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A matmul's parts (GGUF blocks (N_p, row bytes) each, stacked by rows) as the AMX tile GEMM
    reads them (engine/csrc/block_quant_gemm.cpp): the integer weights q (engine/models/gguf_types.py
    block_integers) as bf16 (exact) in tile order; the scales d and offsets m (zero for a part
    without) as (K / 32, N) fp32, so 16 columns' scales of a block load as one vector. w = d * q (+ m)."""
    integers = [gguf_types.block_integers(blocks, qtype) for qtype, blocks in parts]
    q = torch.cat([part_q.to(torch.bfloat16) for part_q, _, _ in integers])
    scales = torch.cat([d for _, d, _ in integers]).t().contiguous()
    offsets = None
    if any(m is not None for _, _, m in integers):
        offsets = torch.cat([m if m is not None else torch.zeros_like(d) for _, d, m in integers]).t().contiguous()
    return tile_order(q), scales, offsets


def widest_integers(parts: list[tuple[GGMLQuantizationType, np.ndarray]]) -> torch.dtype:
    """The narrowest integer dtype holding every part's block integers: int8, or int16 (Q6_K)."""
    return torch.int16 if any(qtype == GGMLQuantizationType.Q6_K for qtype, _ in parts) else torch.int8


def bf16_pair_tiles(weight: torch.Tensor) -> torch.Tensor:
    """Weights (N, K) that are each exactly hi + lo, two bf16 values (`int8_blocks`' d * q), as the
    bf16 tile GEMM reads them: (N / 16, K / 32, 2 * 512), per block hi's tile then lo's."""
    hi = weight.bfloat16()
    lo = (weight - hi.float()).bfloat16()
    if not torch.equal(hi.float() + lo.float(), weight):
        raise ValueError("weights are not exactly two bf16 values each")
    return torch.cat([tile_order(hi), tile_order(lo)], dim=-1)


def int8_blocks(weight: torch.Tensor) -> np.ndarray:
    """The `int8` mode's weights: GGUF Q8_0 blocks (N, K / 32 * 34), q = round(w / d) in
    [-127, 127] with d rounded to bf16's 8 significant bits (stored as fp16, which holds them; an
    fp16 subnormal holds fewer), so d * q has at most 15 and is exactly two bf16 values."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    stored = _bf16_scale(blocks.abs().amax(-1) / 127).half()
    d = stored.float()[..., None]
    q = torch.where(d > 0, torch.round(blocks / d), 0).clamp(-127, 127).to(torch.int8)
    out = np.empty((rows, cols // BLOCK, GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]), np.uint8)
    out[..., :2] = stored.numpy().view(np.uint8).reshape(rows, cols // BLOCK, 2)
    out[..., 2:] = q.numpy().view(np.uint8)
    return out.reshape(rows, -1)


class BlockQuantLinear(nn.Module):
    """A matmul on GGUF block-quantized weights with block-quantized activations, or with
    `bf16_activations` (Q8_0 blocks from `int8_blocks`) activations rounded to bf16. `parts`: the
    weights as (GGML type, blocks (N_p, row bytes)) stacked by rows, a fused matmul whose parts a
    file stores in different types keeping each in its own (engine/models/gguf_types.py). Up to
    `decode_rows` rows (decode steps, small chunks) run the C++ kernel, which reads only the blocks.
    Larger inputs (prefill, large decode batches) run, where the CPU has AMX tiles and the
    integers fit bf16 exactly, the tile GEMM (on the blocks' integers, the same integer dot products
    per block; or on the exact weights as bf16 pairs: a copy of the weights in that layout); else the
    vector GEMM (`vectored`: the same products on AVX512-VNNI, AVX-512 or AVX2, and with bf16
    activations on AVX512-BF16, on the blocks themselves, each pass's unpacked as it goes); else fp32
    GEMM of the dequantized weights on the same rounded activations: the same values every way, so
    the same results to fp32 rounding, whatever the batch. Without the compiled kernels every
    input takes the fp32 GEMM."""

    DECODE_ROWS = 28  # up to here the kernel beats fp32 GEMM on this model family's shapes (BENCHMARKS.md)
    TILED_DECODE_ROWS = 8  # with AMX tiles, the tile GEMM beats the kernel from 5-8 rows on (BENCHMARKS.md)
    # the vector GEMM, which unpacks each weight once a call, beats the kernel from VECTOR_DECODE_ROWS + 1 rows on
    # (BENCHMARKS.md)
    VECTOR_DECODE_ROWS = 28
    # bf16 activations: up to these rows the integer tiles (2 bytes a weight, scaled per block) run, past
    # them the exact bf16 pairs (4 bytes a weight, no scaling inside K) (BENCHMARKS.md)
    INTEGER_TILE_ROWS = 64
    bias: torch.Tensor | None
    dense_weight: torch.Tensor | None
    pair_tiles: torch.Tensor | None
    tiles: torch.Tensor | None
    scales: torch.Tensor | None
    offsets: torch.Tensor | None

    def __init__(self, parts: list[tuple[GGMLQuantizationType, np.ndarray]], bias: torch.Tensor | None, kernels,
                 bf16_activations: bool = False):
        super().__init__()
        qtypes = [qtype for qtype, _ in parts]
        if bf16_activations and qtypes != [GGMLQuantizationType.Q8_0]:
            raise ValueError(f"bf16 activations take one part of Q8_0 blocks, got {[q.name for q in qtypes]}")
        self.qtypes, self.bf16_activations = qtypes, bf16_activations
        self.formats = [BF16_Q8_0_FORMAT] if bf16_activations else [KERNEL_FORMATS[q] for q in qtypes]
        for i, (qtype, blocks) in enumerate(parts):  # (N_p, row bytes) uint8 each, as the kernel reads them
            self.register_buffer(f"rows{i}", torch.from_numpy(gguf_types.kernel_rows(blocks, qtype)))
        self.register_buffer("bias", bias.detach() if bias is not None else None)
        self._kernels = kernels
        self.weight_bytes = sum(rows.numel() for rows in self.part_rows)  # what a decode step reads
        weights, block_bytes = GGML_QUANT_SIZES[qtypes[0]]
        self.in_features = parts[0][1].shape[1] // block_bytes * weights  # K: a row's blocks' weights
        # the batch GEMMs take 16 output columns at a time
        whole_groups = kernels is not None and all(blocks.shape[0] % 16 == 0 for _, blocks in parts)
        integers = widest_integers(parts)
        # AMX's bf16 tiles hold the integers exactly up to 8 bits: Q6_K's folded 16-bit ones take the vector GEMM
        self.tiled = whole_groups and integers == torch.int8 and kernels.block_quant_gemm_available()
        # the plain loop (a build without AVX2) is slower than fp32 GEMM: that keeps the GEMM
        self.vectored = (whole_groups and not self.tiled and kernels.vector_gemm_isa() != "plain"
                         and (kernels.vector_gemm_bf16() or not bf16_activations))
        self.decode_rows = (self.TILED_DECODE_ROWS if self.tiled else self.VECTOR_DECODE_ROWS if self.vectored
                            else self.DECODE_ROWS)  # rows the kernel takes
        tiles, scales, offsets = tile_blocks(parts) if self.tiled else (None, None, None)
        # fp32 weights (N, K) only where the fp32 GEMM is a path the engine takes: elsewhere they would
        # cost 4 bytes a weight of memory, and their dequantizing a share of every start (BENCHMARKS.md)
        dense = None if self.tiled or self.vectored else _dequantized(parts)
        self.register_buffer("dense_weight", dense)
        pair_tiles = bf16_pair_tiles(_dequantized(parts)) if self.tiled and bf16_activations else None
        self.register_buffer("pair_tiles", pair_tiles)
        self.register_buffer("tiles", tiles)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    @property
    def kinds(self) -> list[str]:
        """What each part runs as: its GGML type, or `int8` (Q8_0 blocks times bf16 activations)."""
        return ["int8"] if self.bf16_activations else [qtype.name for qtype in self.qtypes]

    @property
    def part_rows(self) -> list[torch.Tensor]:
        """Each part's rows as the decode kernel reads them."""
        return [getattr(self, f"rows{i}") for i in range(len(self.qtypes))]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (N, K) fp32, which only the fp32 GEMM reads: made at load where that
        is the large-batch path, else on first use, and kept."""
        if self.dense_weight is None:
            self.dense_weight = _dequantized([(qtype, gguf_types.stored_blocks_of(rows.cpu().numpy(), qtype))
                                              for qtype, rows in zip(self.qtypes, self.part_rows)])
        return self.dense_weight

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return getattr(self, self.path(x.shape[0]))(x, norm, gated, residual)

    def path(self, rows: int) -> str:
        """The forward_* method that takes `rows` rows."""
        if self._kernels is not None and rows <= self.decode_rows:
            return "forward_kernel"
        return "forward_tiles" if self.tiled else "forward_vector" if self.vectored else "forward_gemm"

    def forward_vector(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """The vector GEMM on the rows, prologue and residual fused (needs `vectored`)."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        residual = None if residual is None else residual.contiguous()
        return self._kernels.vector_gemm(x.contiguous(), self.part_rows, self.formats, self.bias, norm_weight, eps,
                                         _gate_code(gated), residual)

    def forward_tiles(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """The AMX tile GEMM, prologue and residual fused (needs `tiled`)."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        residual = None if residual is None else residual.contiguous()
        if self.pair_tiles is not None and x.shape[0] > self.INTEGER_TILE_ROWS:
            return self._kernels.bf16_tile_gemm(x.contiguous(), self.pair_tiles, self.bias, norm_weight, eps,
                                                _gate_code(gated), residual)
        return self._kernels.block_quant_gemm(x.contiguous(), self.tiles, self.scales, self.offsets, self.bias,
                                              norm_weight, eps, _gate_code(gated), residual, self.bf16_activations)

    def forward_kernel(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """The C++ kernel on the blocks, prologue and residual fused (needs the kernels)."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        return self._kernels.block_quant_linear(x.contiguous(), self.part_rows, self.formats, self.bias, norm_weight,
                                                eps, _gate_code(gated), residual)

    def forward_gemm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 GEMM of the dequantized weights on the same rounded activations."""
        return _plus(residual, F.linear(self.activations(x, norm, gated), self.weight, self.bias))

    def activations(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                    gated: str | None = None) -> torch.Tensor:
        """prologue(x) as this layer's kernels see it: rounded to bf16, or quantized per block.
        With the compiled kernels loaded, their own prologue and rounding compute it, so every
        path multiplies the same values: an fp32 norm a rounding apart from torch's can land on
        the other side of a bf16 step."""
        if self._kernels is not None:
            norm_weight, eps = norm if norm is not None else (None, 0.0)
            return self._kernels.kernel_activations(x.contiguous(), norm_weight, eps, _gate_code(gated),
                                                    self.bf16_activations)
        x = prologue(x, norm, gated)
        return x.bfloat16().float() if self.bf16_activations else quantize_activations(x)


class WeightOnlyLinear(nn.Module):
    """A matmul on int8 or int4 weights with bf16 activations, by torch's weight-only CPU kernels:
    8 bits, one scale per output channel (`_weight_int8pack_mm`); 4 bits, a scale and an offset
    per block of 32 like GGUF's Q4_1 (`_weight_int4pack_mm_for_cpu`). Scales are rounded to
    bf16 before the weights are rounded to them, so the kernel computes with the grid the weights
    were fitted to. The prologue and the residual stay fp32."""
    packed: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, bits: int, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.bits = bits
        w = weight.detach().float()
        if bits == 8:
            scale = _bf16_scale(w.abs().amax(1) / 127)
            self.register_buffer("packed", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale.bfloat16())
        else:
            rows, cols = w.shape
            blocks = w.view(rows, cols // BLOCK, BLOCK)
            low = blocks.amin(-1)
            scale = _bf16_scale((blocks.amax(-1) - low) / 15)
            zero = (low + 8 * scale).bfloat16().float()  # the kernel computes (q - 8) * scale + zero
            q = torch.round((blocks - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.view(rows, cols), 1))
            self.register_buffer("scales", torch.stack([scale.t(), zero.t()], -1).bfloat16().contiguous())
        self.register_buffer("bias", bias.detach() if bias is not None else None)
        self.weight_bytes = self.packed.numel() + 2 * self.scales.numel()

    @staticmethod
    def fits(bits: int, weight: torch.Tensor) -> bool:
        """The kernels' shape rules: rows of whole blocks; int4 packs 16 output channels at a time."""
        rows, cols = weight.shape
        return cols % BLOCK == 0 and (bits == 8 or rows % 16 == 0)

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        a = prologue(x, norm, gated).to(torch.bfloat16)
        if self.bits == 8:
            out = torch._weight_int8pack_mm(a, self.packed, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(a, self.packed, BLOCK, self.scales)
        out = out.float()
        if self.bias is not None:
            out += self.bias
        return _plus(residual, out)


def _dequantized(parts: list[tuple[GGMLQuantizationType, np.ndarray]]) -> torch.Tensor:
    return torch.cat([gguf_types.dequantize(blocks, qtype) for qtype, blocks in parts])


def _gate_code(gated: str | None) -> int:
    """The kernels' prologue code of a gated activation: 0 none (GATED_ACTIVATIONS)."""
    return 0 if gated is None else GATED_ACTIVATIONS[gated]


def _bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    """A positive scale as bf16 represents it, in fp32 (an all-equal block gets the smallest)."""
    return scale.clamp_min(torch.finfo(torch.bfloat16).tiny).bfloat16().float()


WEIGHT_ONLY_BITS = {"w8a16": 8, "w4a16": 4}


def quantize(model: PagedModel, mode: str, gguf=None) -> PagedModel:
    """Replaces the Linears of `model` by the mode's implementation, in place. `int8`, `w8a16`,
    `w4a16`: every matmul whose shape the kernel takes (input width a multiple of 32; others stay
    fp32), except that the weight-only modes keep the LM head fp32, as GPTQ and AWQ checkpoints
    do (a 4-bit LM head alone costs more top-1 agreement than every other matmul together).
    `gguf`: each matmul in the checkpoint's own blocks, `gguf` the file mapped
    (engine/models/gguf_blocks.py MappedGGUF; those Linears hold no weights), and one with a part of
    a type no kernel runs, or that the file does not store as the paged model's parts, as `int8`."""
    if mode not in QUANTIZATION_MODES or mode == "auto":  # auto is resolved before (engine/model_setup.py)
        raise ValueError(f"quantize takes one of {QUANTIZATION_MODES[:-1]}, got {mode!r}")
    if mode == "none":
        return model
    from engine.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels() if mode in ("int8", "gguf") else None
    kinds: Counter[str] = Counter()  # what the matmuls' parts run as
    # a bar where quantizing takes a while (a large checkpoint's int8: seconds a layer); none for mapped blocks
    replacement: nn.Module
    for name, dense in tqdm(list(model.named_modules()), desc=f"quantization {mode}", unit="module", delay=3):
        if not isinstance(dense, Linear):
            continue
        if mode in WEIGHT_ONLY_BITS:
            bits = WEIGHT_ONLY_BITS[mode]
            if dense is model.lm_head or not WeightOnlyLinear.fits(bits, dense.weight):
                continue
            replacement = WeightOnlyLinear(bits, dense.weight, dense.bias)
        elif mode == "gguf" and gguf is not None and (parts := gguf.parts(name)) is not None:
            replacement = BlockQuantLinear(parts, dense.bias, kernels)
        elif dense.weight.shape[1] % BLOCK == 0:  # `int8`, or a tensor of a type no kernel runs
            weight = gguf.dense(name) if dense.weight.is_meta else dense.weight
            replacement = BlockQuantLinear([(GGMLQuantizationType.Q8_0, int8_blocks(weight))], dense.bias,
                                           kernels, bf16_activations=True)
        else:
            continue
        kinds.update(replacement.kinds if isinstance(replacement, BlockQuantLinear) else [mode])
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, replacement)
    logger.info("matmuls %s: %s", mode, ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
    if kernels is not None and (why_not := model.fuse_decode_stack(kernels)) is not None:
        logger.info("quantization %s: decode steps run layer by layer, not in the fused decode stack: %s", mode,
                    why_not)
    return model


def weight_bytes_per_token(module: nn.Module) -> int:
    """Bytes of matmul weights one decode step of one token reads (embeddings are a row lookup; of
    a mixture of experts, its `decode_weight_bytes`: the experts a token is routed to)."""
    if isinstance(module, (Linear, BlockQuantLinear, WeightOnlyLinear)):
        return module.weight_bytes
    if (decode_weight_bytes := getattr(module, "decode_weight_bytes", None)) is not None:  # experts
        return decode_weight_bytes(weight_bytes_per_token)
    return sum(weight_bytes_per_token(child) for child in module.children())
