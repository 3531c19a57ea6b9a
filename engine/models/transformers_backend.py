"""Any decoder-only transformers model without a native family, run by transformers' own modeling
code with the engine's paged attention plugged into transformers' attention interface (as vLLM's
Transformers backend does), so it keeps continuous batching, the paged KV cache, prefix caching
and preemption.

The step's flat ragged batch goes through the model as one sequence of T tokens (batch 1) with
each token's own position; transformers computes embeddings, positions (RoPE or learned), norms
and MLPs as it always does, and every attention layer calls `paged_attention`, which writes the
layer's keys and values into the paged cache and attends through the backend with the layer's KV
group, exactly as native layers do. No causal mask is built (the backend's metadata is the mask).
Each matmul of the decoder layers and the LM head is an engine.models.linear matmul (wrapped to
take transformers' (batch, tokens, features) inputs; GPT-2's Conv1D as its transpose), so the
quantized modes and `auto` apply; the fused C++ decode stack does not. Logits are computed at the
sampled positions only, with whatever the model's head applies after its projection.

Refused, with the reason: modeling code that takes no pluggable attention function (ALiBi
biases, recurrent or state-space layers), non-attention layer types (linear attention), encoder-
decoders, attention sinks (gpt-oss) and per-layer scales or soft-caps the backend does not hold.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.pytorch_utils import Conv1D

from engine.attention.base import AttentionBackend, AttentionParams
from engine.kv_cache.layout import KVLayout
from engine.models.linear import Linear
from engine.models.paged_model import PagedModel
from engine.models.windows import layer_windows

ATTENTION = "cbserve_paged"
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(slots=True)
class PagedStep:
    """What the layers' attention calls read of the step (passed through the model's kwargs)."""
    kv_cache: torch.Tensor
    backend: AttentionBackend
    metadata: list[Any]  # per KV group
    layout: KVLayout


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, paged: PagedStep | None = None, **kwargs):
    """transformers' attention interface: query (1, heads, T, d), key/value (1, kv_heads, T, d) ->
    (1, T, heads, d), None. Written to and read from the paged cache of the module's layer."""
    if paged is None:
        raise RuntimeError("the paged attention runs inside the engine's forward only")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks are not supported by the paged attention")
    backend, layer = paged.backend, module.layer_idx
    if softcap != backend.softcap:
        raise ValueError(f"layer {layer} soft-caps its scores at {softcap}; the paged attention holds "
                         f"{backend.softcap} for every layer")
    if scaling is not None and scaling != backend.scale:  # a layer's own scale (OPT scales q itself and passes 1)
        query = query * (scaling / backend.scale)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, heads, d)
    out = backend.forward(q, k, v, paged.kv_cache[paged.layout.slot_of[layer]],
                          paged.metadata[paged.layout.group_of[layer]])
    return out.view(1, q.shape[0], q.shape[1], -1), None


AttentionInterface.register(ATTENTION, paged_attention)


class TokenLinear(nn.Module):
    """A transformers projection as an engine matmul (`linear`, which quantize() replaces) over
    (..., features) inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.linear = Linear(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def decoder_layers(hf_model) -> nn.ModuleList:
    """The model's stack of decoder layers: the first ModuleList of num_hidden_layers modules."""
    count = hf_model.config.num_hidden_layers
    for module in hf_model.base_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(hf_model).__name__}: no stack of {count} decoder layers found")


def _attention_modules(hf_model) -> list[nn.Module]:
    """Each decoder layer's attention module (the one holding its layer_idx)."""
    found = []
    for index, layer in enumerate(decoder_layers(hf_model)):
        module = next((m for m in layer.modules() if getattr(m, "layer_idx", None) == index), None)
        if module is None:
            raise ValueError(f"layer {index} of {type(hf_model).__name__} has no attention module with its layer_idx")
        found.append(module)
    return found


def fallback_refusal(hf_model) -> str | None:
    """Why the model cannot run through its own modeling code with the paged attention, or None."""
    config = hf_model.config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    layer_types = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if layer_types:
        return f"it has layers without standard attention ({', '.join(sorted(layer_types))})"
    if not getattr(hf_model, "_supports_attention_backend", False):
        return ("its transformers modeling code takes no pluggable attention function (attention with ALiBi "
                "biases, or recurrent or state-space layers)")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in hf_model.modules()):
        return "it uses attention sinks, which the paged attention does not compute"
    try:
        _attention_modules(hf_model)
    except ValueError as e:
        return str(e)
    return None


class TransformersDecoder(PagedModel):
    model_path = "transformers"

    def __init__(self, hf_model, max_model_len: int):
        super().__init__()
        config = hf_model.config
        self.architecture = type(hf_model).__name__
        first = _attention_modules(hf_model)[0]
        self.num_heads = config.num_attention_heads
        groups = getattr(first, "num_key_value_groups", None)  # the module's own count, where it keeps one
        self.num_kv_heads = (self.num_heads // groups if groups else getattr(config, "num_key_value_heads", None)
                             or self.num_heads)
        self.head_dim = getattr(first, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size  # an embedding's size
        self.kv_layout = KVLayout.for_windows(layer_windows(config, _attention_modules(hf_model)), max_model_len)
        softcap = getattr(first, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None)
        self.attention = AttentionParams(getattr(first, "scaling", None) or self.head_dim ** -0.5, softcap)
        hf_model.set_attn_implementation(ATTENTION)
        _as_engine_matmuls(decoder_layers(hf_model))
        head = hf_model.get_output_embeddings()
        hf_model.set_output_embeddings(TokenLinear(head.weight.detach(), None if head.bias is None else head.bias))
        self.hf_model = hf_model.eval()
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        self.decode_stack, self.decode_rows = None, 0

    @property
    def lm_head(self) -> Linear:
        """The LM head's matmul (the weight-only modes keep it fp32)."""
        return self.hf_model.get_output_embeddings().linear

    def fuse_decode_stack(self, kernels: Any) -> str:
        return "it runs through transformers' modeling code"

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, backend: AttentionBackend, metadata: list, sample_indices,
                num_layers: int | None = None, pooled_indices=None):
        """Logits (R, vocab) for the tokens at sample_indices, as PagedDecoder.forward (with
        `pooled_indices`, also the last hidden states there: the model's final norm's output)."""
        if num_layers is not None:
            raise ValueError("self-drafting needs a natively served family")
        step = PagedStep(kv_cache, backend, metadata, self.kv_layout)
        kwargs = {"logits_to_keep": sample_indices} if self._keeps_logits and pooled_indices is None else {}
        out = self.hf_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, paged=step,
                            output_hidden_states=pooled_indices is not None, **kwargs)
        logits = out.logits[0] if kwargs else out.logits[0][sample_indices]
        return logits if pooled_indices is None else (logits, out.hidden_states[-1][0][pooled_indices])


def _as_engine_matmuls(layers: nn.Module) -> None:
    """Replaces every nn.Linear and Conv1D under `layers` by a TokenLinear, in place."""
    for name, module in list(layers.named_modules()):
        if isinstance(module, nn.Linear):
            replacement = TokenLinear(module.weight.detach(), None if module.bias is None else module.bias.detach())
        elif isinstance(module, Conv1D):  # weight (in, out)
            replacement = TokenLinear(module.weight.detach().t().contiguous(), module.bias.detach())
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(layers.get_submodule(parent) if parent else layers, attr, replacement)
