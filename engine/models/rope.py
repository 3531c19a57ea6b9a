"""RoPE tables for a paged decoder, from the checkpoint's own rotary module, so every rope scaling
transformers implements (llama3, linear, yarn, longrope, ...) is reproduced as it computes it.

One table per kind of layer that rotates alike: one for most families; Gemma 3's local and global
layers (their own bases); an identity for layers without RoPE (SmolLM3's NoPE layers). Tables
are (max_len, head_dim), sin's first half negated, so the rotation is x * cos + roll(x) * sin.

Partial rotary (Phi-4-mini rotates the first 3/4 of each head) is made whole by a permutation of
each head's dimensions: the q and k projections' rows are reordered so the rotated pairs sit at
(i, i + head_dim / 2) and the dimensions that pass through get cos 1 and sin 0; q . k is
unchanged by permuting both alike (the cache keeps permuted keys, which only permuted queries
read). Rope types whose frequencies depend on the sequence's length (longrope, dynamic) take,
for positions inside the original context, the frequencies of a sequence that fits it, and past
it those of the longest context: transformers' own choice for a sequence of that length.
"""
from __future__ import annotations

import inspect

import torch

LENGTH_DEPENDENT = ("longrope", "dynamic")


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """new dimension -> old one, so the rotated pairs (i, i + rotary_dim / 2) land at (i, i + head_dim / 2)."""
    half, r2, rest = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r2), rotary_dim + torch.arange(rest),
                      r2 + torch.arange(r2), rotary_dim + rest + torch.arange(half - r2)])


@torch.no_grad()
def rope_tables(rotary_emb, config, kinds: list[str | None], head_dim: int, max_len: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin) (len(kinds), max_len, head_dim) fp32 and the rotary dimension, one table per
    kind: a layer type the rotary module takes (Gemma 3), "default" for a module without layer
    types, None for no RoPE."""
    takes_layer_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
    tables = [_table(rotary_emb, config, kind if takes_layer_type else None, max_len) if kind is not None else None
              for kind in kinds]
    rotary_dim = next((cos.shape[-1] for cos, _ in filter(None, tables)), head_dim)
    cos_all, sin_all = torch.ones(len(kinds), max_len, head_dim), torch.zeros(len(kinds), max_len, head_dim)
    half, r2 = head_dim // 2, rotary_dim // 2
    for k, table in enumerate(tables):
        if table is None:
            continue  # no RoPE: identity
        cos, sin = table
        for part, out in ((cos, cos_all[k]), (sin, sin_all[k])):
            out[:, :r2], out[:, half:half + r2] = part[:, :r2], part[:, r2:rotary_dim]
        sin_all[k, :, :half] = -sin_all[k, :, :half]
    return cos_all, sin_all, rotary_dim


def _table(rotary_emb, config, layer_type: str | None, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (max_len, rotary_dim) fp32 as transformers' rotary module computes them."""
    cos, sin = _call(rotary_emb, layer_type, max_len)
    rope_type = rotary_emb.rope_type[layer_type] if layer_type is not None else rotary_emb.rope_type
    if rope_type in LENGTH_DEPENDENT:
        params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
        original = (params.get("original_max_position_embeddings") if rope_type == "longrope"
                    else rotary_emb.original_max_seq_len)
        if original and original < max_len:
            cos[:original], sin[:original] = _call(rotary_emb, layer_type, original)
    return cos, sin


def _call(rotary_emb, layer_type: str | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    probe = torch.zeros(1, 1, 1, dtype=torch.float32)
    positions = torch.arange(length)[None]
    args = (probe, positions) if layer_type is None else (probe, positions, layer_type)
    cos, sin = rotary_emb(*args)
    return cos[0].float().clone(), sin[0].float().clone()
