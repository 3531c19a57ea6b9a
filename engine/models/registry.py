"""Maps a transformers architecture name to the paged model class that serves it."""
from __future__ import annotations

from engine.models.llama import LlamaForPagedAttention

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForPagedAttention,
    "MistralForCausalLM": LlamaForPagedAttention,
    "Qwen2ForCausalLM": LlamaForPagedAttention,
}


def build_model(hf_model, max_model_len: int):
    name = type(hf_model).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name}; supported: {sorted(ARCHITECTURES)}")
    sliding_window = getattr(hf_model.config, "sliding_window", None)
    if sliding_window and getattr(hf_model.config, "use_sliding_window", True) and sliding_window < max_model_len:
        raise ValueError(f"sliding_window {sliding_window} < max_model_len {max_model_len} is not supported; "
                         f"pass max_model_len <= {sliding_window}")
    return ARCHITECTURES[name](hf_model, max_model_len)
