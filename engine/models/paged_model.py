"""`PagedModel`: what the engine reads of a model over the paged KV cache, whichever path built it
(the native decoder, engine/models/decoder.py, or transformers' modeling code,
engine/models/transformers_backend.py), declared once so the engine's reads are typed."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.attention.base import AttentionParams
from engine.kv_cache.layout import KVLayout


class PagedModel(nn.Module):
    model_path: str  # "native" or "transformers"
    architecture: str  # the checkpoint's model class
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    hidden_size: int  # an embedding's size
    kv_layout: KVLayout
    attention: AttentionParams
    decode_stack: Any  # the C++ kernels' fused decode stack, or None
    decode_rows: int  # steps of up to this many rows run in it

    def fuse_decode_stack(self, kernels: Any) -> str | None:
        """Runs decode steps in the kernels' fused stack; None, or why it cannot."""
        raise NotImplementedError
