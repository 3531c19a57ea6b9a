"""A decoder layer's MLP: a gated one (down(act(gate) * up)), or a mixture of experts (Mixtral,
Qwen3-MoE, Qwen2-MoE), where a router picks each token's top-k gated experts and weighs their
outputs; Qwen2-MoE adds a shared expert, gated per token by a sigmoid.

Routing is transformers': softmax in float32 of the router's logits, the top k, renormalised
to sum to one where the family does (Mixtral always; Qwen as config.norm_topk_prob), then cast
to the activations' dtype. Tokens are grouped by expert (a stable sort of the (token, slot)
pairs), so each expert the step routes to runs once over all its tokens and its weights are
read once per step; an expert no token chose is not read at all (a lone stream reads its k).
Each expert's gate/up and down are engine.models.linear matmuls, so the quantized modes run
them through the same kernels as dense layers; the router is never quantized (a few thousand
weights that decide everything after them). A 16-bit model on CUDA runs all experts' gate/up, then all
their downs, as one grouped matmul each (engine/models/cuda_ops.py), over the experts' weights
stacked at its first step; nothing there waits for the host (no count comes back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear import GATED_ACTIVATIONS, Linear, fused_ops


class GatedMLP(nn.Module):
    """down(act(gate) * up), gate and up one fused matmul (the dense MLP, and each expert)."""
    gate_up: nn.Module  # a Linear, or what engine.models.linear.quantize made of it
    down: nn.Module

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, activation: str,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        super().__init__()
        self.gate_up = Linear(gate_up, gate_up_bias)  # (2 * intermediate, hidden)
        self.down = Linear(down, down_bias)  # (hidden, intermediate)
        self.activation = activation
        self.matmul_shapes = [tuple(gate_up.shape), tuple(down.shape)]  # (N, K) of each

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + down(act(gate) * up) of x (T, hidden), normed first where `norm` is given."""
        return self.down(self.gate_up(x, norm=norm), gated=self.activation, residual=residual)


class Experts(nn.Module):
    router: torch.Tensor
    shared_gate: torch.Tensor | None

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str,
                 top_k: int, renormalize: bool, shared: GatedMLP | None = None,
                 shared_gate: torch.Tensor | None = None):
        """router (E, hidden); gate_up (E, 2 * intermediate, hidden) and down (E, hidden,
        intermediate) stacked as transformers keeps them; `shared`, `shared_gate` (1, hidden):
        Qwen2-MoE's shared expert and its gate."""
        super().__init__()
        self.register_buffer("router", router.detach().contiguous())
        self.experts: list[GatedMLP] = nn.ModuleList(  # type: ignore[assignment]  # registered, typed as a list
            GatedMLP(gu, d, activation) for gu, d in zip(gate_up, down))
        self.top_k, self.renormalize = top_k, renormalize
        self.shared = shared
        self._stacked_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # for the grouped matmul
        self.register_buffer("shared_gate", None if shared_gate is None else shared_gate.detach().contiguous())

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def decode_weight_bytes(self, bytes_of) -> int:
        """Matmul bytes one token reads (`bytes_of` a module's): its top_k experts' (an average
        expert's) and the shared expert's."""
        experts = sum(bytes_of(expert) for expert in self.experts) * self.top_k // self.num_experts
        return experts + (0 if self.shared is None else bytes_of(self.shared))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts (T, k) and their weights (T, k) in x's dtype."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)  # (T, E): logits in x's dtype, as transformers
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), normed: the experts' weighted outputs (T, hidden), plus the shared expert's."""
        if (ops := fused_ops(x)) is not None:
            return self.forward_grouped(x, ops)
        experts, weights = self.route(x)
        order = torch.argsort(experts.flatten(), stable=True)  # (T * k,) (token, slot) pairs by expert
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        flat_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start:start + count]
                y = expert(x[rows]) * flat_weights[start:start + count, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return self._with_shared(x, out)

    def forward_grouped(self, x: torch.Tensor, ops) -> torch.Tensor:
        """forward with every expert's matmuls in one grouped matmul (`ops`: engine.models.cuda_ops)."""
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        tokens = order // self.top_k
        gate_up, down = self._stacked()
        activation = GATED_ACTIVATIONS[self.experts[0].activation]
        hidden = ops.gated(ops.grouped_matmul(x[tokens], gate_up, starts), activation)
        y = ops.grouped_matmul(hidden, down, starts) * weights.flatten()[order, None]
        return self._with_shared(x, torch.zeros_like(x).index_add_(0, tokens, y))

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared_gate is not None:
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' gate/up (E, 2 * intermediate, hidden) and down (E, hidden, intermediate)
        weights as two tensors, stacked on first use; each expert's matmuls then read views of them."""
        if self._stacked_weights is None:
            stacked = (torch.stack([_dense(e.gate_up).weight for e in self.experts]),
                       torch.stack([_dense(e.down).weight for e in self.experts]))
            for e, expert in enumerate(self.experts):
                for part, weights in zip(("gate_up", "down"), stacked):
                    getattr(expert, part).weight = nn.Parameter(weights[e], requires_grad=False)
            self._stacked_weights = stacked
        return self._stacked_weights


def _dense(matmul: nn.Module) -> Linear:
    """An expert's matmul where the grouped matmul reads it: dense (CUDA runs no quantized mode)."""
    if not isinstance(matmul, Linear):
        raise TypeError(f"the grouped matmul reads dense experts, got a {type(matmul).__name__}")
    return matmul
