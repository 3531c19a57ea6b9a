"""The decoder families the engine runs natively, each a small description of what it changes
over the shared parts of engine/models/decoder.py (as llama.cpp's per-architecture graph builders
over shared ops, and transformers' modular files, describe a family by what differs).

What the checkpoint's own modules show is read from them, not described: fused projections
(Phi-3's qkv_proj and gate_up_proj), q/k norms, biases, the activation, each layer's sliding
window and RoPE kind, dense layers among expert ones (Qwen3-MoE's mlp_only_layers), shared
experts (Qwen2-MoE). What the modules do not show is described here:

- Llama, Mistral, Qwen2, Phi-3, SmolLM3: RMSNorm, pre-norms, scores by 1/sqrt(head_dim) (the base).
- Qwen3: the base with q/k norms.
- Gemma: RMSNorm by 1 + w, embeddings times sqrt(hidden_size).
- Gemma 2: Gemma with post-norms around attention and MLP, scores by query_pre_attn_scalar ** -0.5 and
  soft-capped, logits soft-capped, sliding windows on alternate layers.
- Gemma 3 (text): Gemma 2's description (its caps unset) with q/k norms, local and global layers with
  their own RoPE tables.
- Mixtral: the base with experts, top-k of the router's softmax renormalised.
- Qwen3-MoE, Qwen2-MoE: the base with experts (Qwen3: q/k norms; Qwen2: a shared expert), the
  top-k renormalised as config.norm_topk_prob says.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    norm_offset: bool = False  # RMSNorm scales by 1 + weight (Gemma): folded into the weight at load
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model's dtype (Gemma)
    sandwich_norms: bool = False  # attention's and the MLP's outputs are normed before their residual adds
    query_scale_field: str | None = None  # config field f: scores scaled by f ** -0.5, not head_dim ** -0.5
    attention_softcap_field: str | None = None  # config field: scores soft-capped by its value (None: not)
    final_softcap_field: str | None = None  # config field: logits soft-capped by its value (None: not)
    renormalize_experts: bool | None = None  # top-k expert weights renormalised; None: as config.norm_topk_prob


LLAMA = Family()
GEMMA = Family(norm_offset=True, embed_scale=True)
GEMMA2 = replace(GEMMA, sandwich_norms=True, query_scale_field="query_pre_attn_scalar",
                 attention_softcap_field="attn_logit_softcapping", final_softcap_field="final_logit_softcapping")
MIXTRAL = Family(renormalize_experts=True)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Phi3ForCausalLM": LLAMA,
    "SmolLM3ForCausalLM": LLAMA,
    "GemmaForCausalLM": GEMMA,
    "Gemma2ForCausalLM": GEMMA2,
    "Gemma3ForCausalLM": GEMMA2,
    "MixtralForCausalLM": MIXTRAL,
    "Qwen3MoeForCausalLM": LLAMA,
    "Qwen2MoeForCausalLM": LLAMA,
}
