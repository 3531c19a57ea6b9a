"""Attention backends: write K/V into paged slots, attend over ragged queries with block tables."""
from engine.attention.base import AttentionBackend
from engine.attention.selector import select_backend

__all__ = ["AttentionBackend", "select_backend"]
