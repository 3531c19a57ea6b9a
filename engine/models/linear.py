"""The model's matmuls, one class per execution mode, chosen by `quantization` at load time.

`none`: fp32 weights, F.linear (the reference: exact parity with transformers). `int8`: int8
weights in groups of 32 with fp32 activations (weight-only). Weight-only because quantizing
the activations too (fbgemm's dynamic int8, per-tensor, 7-bit on x86) cost this model family far
too much quality: on SmolLM2-135M top-1 agreement with fp32 fell to 49% (80% with SmoothQuant
scales folded in), where weight-only int8 keeps it above 97% (engine/quality.py, BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_MODES = ("none", "int8")


class Linear(nn.Module):
    """y = x W^T + b in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear(nn.Module):
    """Weights rounded to int8 in groups of GROUP_SIZE consecutive weights of a row (symmetric,
    scale = max |w| / 127 per group, as GGUF's Q8_0), fp32 activations. Up to DECODE_ROWS rows
    (decode steps) run the C++ int8 kernel, which reads ~28% of fp32's bytes; larger inputs
    (prefill) run fp32 GEMM on the same weights dequantized, identical values, so they keep the
    fast GEMM path. Without the compiled kernels every input takes the GEMM path."""

    GROUP_SIZE = 32  # per-row scales (one group) kept top-1 agreement at 95.9% on SmolLM2; 32: 98.0%
    DECODE_ROWS = 8  # the kernel beats fp32 GEMM up to here on this model family's shapes (BENCHMARKS.md)

    def __init__(self, dense: Linear, kernels):
        super().__init__()
        weight = dense.weight.detach().float()
        rows, cols = weight.shape
        group = self.GROUP_SIZE if cols % self.GROUP_SIZE == 0 else cols
        groups = weight.view(rows, cols // group, group)
        scale = (groups.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # (rows, groups)
        qweight = torch.round(groups / scale[..., None]).to(torch.int8)
        self.register_buffer("qweight", qweight.view(rows, cols).contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("weight", (qweight.float() * scale[..., None]).view(rows, cols))
        self.bias = dense.bias
        self._kernels = kernels
        self.weight_bytes = qweight.numel() + 4 * scale.numel()  # what a decode step reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and x.shape[0] <= self.DECODE_ROWS:
            bias = self.bias.detach() if self.bias is not None else None
            return self._kernels.int8_linear(x.contiguous(), self.qweight, self.scale, bias)
        return F.linear(x, self.weight, self.bias)


def quantize(model: nn.Module, mode: str) -> nn.Module:
    """Replaces every Linear of `model` by the mode's implementation, in place."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode == "none":
        return model
    from engine.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear(child, kernels))
    return model


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of matmul weights one decode step reads (embeddings are a row lookup)."""
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, (Linear, Int8Linear)))
