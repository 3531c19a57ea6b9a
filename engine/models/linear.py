"""The model's matmuls, one class per execution mode, chosen by `quantization` at load time, each
with the fusions a decoder layer needs: a prologue on its input (RMSNorm, or SwiGLU of a fused
gate/up output) and a residual added to its output. The fp32 reference runs them as separate torch
ops in transformers' order; the quantized decode kernel fuses them, so a decode step makes a few
calls per layer instead of a dozen small ops (per-op overhead, not arithmetic, dominates there).

`none`: fp32 weights, F.linear (the reference: exact parity with transformers). `int8`: every
matmul re-quantized to GGUF's Q8_0 blocks (int8 weights, one fp16 scale per 32). `gguf`: a GGUF
checkpoint's own blocks (Q4_1, Q8_0) as stored, so no re-quantization error
(engine/models/gguf_blocks.py). Both quantized modes quantize activations per block of 32 to 15
bits, so the decode kernel takes integer dot products (engine/csrc/block_quant_linear.cpp):
llama.cpp's 8-bit activations cost SmolLM2-135M ~3% of top-1 agreement with fp32 (per-tensor
int8, fbgemm's, 49%); 15 bits cost nothing measurable, for two byte products per block.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as quantize_blocks
from torch import nn

from engine.config import QUANTIZATION_MODES

BLOCK = 32  # values per quantization block, of weights and of activations
ACTIVATION_LEVELS = 127 * 128  # activations are integers in [-LEVELS, LEVELS] times a scale per block
KERNEL_FORMATS = {GGMLQuantizationType.Q8_0: 0, GGMLQuantizationType.Q4_1: 1}  # the C++ kernel's format codes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' order in 16-bit dtypes: normalize in float32, round, then scale (fused in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype) * weight


def prologue(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None, swiglu: bool) -> torch.Tensor:
    """RMSNorm with `norm` = (weight, eps), or SwiGLU silu(gate) * up of x = [gate | up], or x."""
    if norm is not None:
        return rms_norm(x, *norm)
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    return x


def _plus(residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    return out if residual is None else residual + out


class Linear(nn.Module):
    """residual + prologue(x) W^T + b in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return _plus(residual, F.linear(prologue(x, norm, swiglu), self.weight, self.bias))

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


class BlockQuantLinear(nn.Module):
    """A matmul on GGUF block-quantized weights with block-quantized activations. Up to
    DECODE_ROWS rows (decode steps, small chunks) run the C++ kernel, which reads only the blocks;
    larger inputs (prefill) run fp32 GEMM of the dequantized weights with the same quantized
    activations: the same values, so the same results to fp32 rounding, whatever the batch.
    Without the compiled kernels every input takes the GEMM path."""

    DECODE_ROWS = 20  # the kernel beats fp32 GEMM up to here on this model family's shapes (BENCHMARKS.md)

    def __init__(self, qtype: GGMLQuantizationType, blocks: np.ndarray, bias: torch.Tensor | None, kernels):
        super().__init__()
        self.qtype, self.format = qtype, KERNEL_FORMATS[qtype]
        self.register_buffer("blocks", torch.from_numpy(np.ascontiguousarray(blocks)))  # (N, K / 32 * bytes) uint8
        self.register_buffer("weight", torch.from_numpy(dequantize(blocks, qtype)))  # (N, K) fp32
        self.register_buffer("bias", bias.detach() if bias is not None else None)
        self._kernels = kernels
        self.weight_bytes = self.blocks.numel()  # what a decode step reads

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._kernels is not None and x.shape[0] <= self.DECODE_ROWS:
            return self.forward_kernel(x, norm, swiglu, residual)
        return self.forward_gemm(x, norm, swiglu, residual)

    def forward_kernel(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """The C++ kernel on the blocks, prologue and residual fused (needs the kernels)."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        return self._kernels.block_quant_linear(x.contiguous(), self.blocks, self.format, self.bias, norm_weight, eps,
                                                swiglu, residual)

    def forward_gemm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 GEMM of the dequantized weights on the same quantized activations."""
        return _plus(residual, F.linear(quantize_activations(prologue(x, norm, swiglu)), self.weight, self.bias))


def quantize(model: nn.Module, mode: str, stored_blocks: dict | None = None) -> nn.Module:
    """Replaces the Linears of `model` by the mode's implementation, in place. `int8`: every
    matmul whose input width is a multiple of 32 (others stay fp32). `gguf`: `stored_blocks`,
    {module name: (GGML type, blocks)} from the checkpoint (engine/models/gguf_blocks.py)."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode == "none":
        return model
    from engine.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    for name, dense in list(model.named_modules()):
        if not isinstance(dense, Linear):
            continue
        if mode == "gguf":
            qtype, blocks = stored_blocks[name]
        elif dense.weight.shape[1] % BLOCK == 0:
            qtype = GGMLQuantizationType.Q8_0
            blocks = quantize_blocks(dense.weight.detach().float().numpy(), qtype)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, BlockQuantLinear(qtype, blocks, dense.bias, kernels))
    return model


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of matmul weights one decode step reads (embeddings are a row lookup)."""
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, (Linear, BlockQuantLinear)))
