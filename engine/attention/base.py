"""The attention backend interface (engine/attention/selector.py chooses one at engine start).

A backend owns the KV cache layout and the per-step attention metadata; the model only calls
`forward(q, k, v, layer_cache, metadata)`. Metadata is built once per step for each KV group
(engine/kv_cache/layout.py): a layer attends with its group's, which carries the group's
sliding window, so every backend reads only the keys a layer's window holds. The scale and the
score soft-cap (Gemma 2's tanh cap) are the model's, the same in every layer.
"""
from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch import GroupTables, ModelInputs


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), but on CPU an anonymous mapping: the OS maps its pages zeroed when they
    are first touched, so a KV pool costs neither start-up time nor resident memory until blocks
    are written (torch.zeros writes every byte: ~0.2 s a GiB). Plain pages: where a huge page is
    asked for (numpy's calloc asks), each first touch may wait for the kernel to compact memory,
    ~6 ms a fault, a second on a first request."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """What a model's attention scores are, the same in every layer."""
    scale: float  # scores are q . k times this (1 / sqrt(head_dim), or Gemma's query_pre_attn_scalar's)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)


class AttentionBackend(ABC):
    name: str
    captures_decodes = False  # decode_metadata reads fixed buffers: decode steps can replay CUDA graphs

    def __init__(self, params: AttentionParams):
        self.scale, self.softcap = params.scale, params.softcap

    @abstractmethod
    def allocate_kv_cache(self, num_slots: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One tensor for all layers; `cache[slot]` is what `forward` receives for a layer in that
        cache slot (KVLayout.slot_of)."""

    @abstractmethod
    def block_dim(self) -> int:
        """The dimension of the whole cache tensor that indexes blocks (swap and copy act on it)."""

    def build_metadata(self, inputs: ModelInputs) -> list[Any]:
        """Per KV group, the step's tensors its layers share (masks, gather indices, block tables)."""
        return [self.group_metadata(inputs, group) for group in inputs.kv_groups]

    @abstractmethod
    def group_metadata(self, inputs: ModelInputs, group: GroupTables) -> Any:
        """One KV group's metadata for the step: its slots, tables and window."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                metadata: Any, kv_written: bool = False) -> torch.Tensor:
        """q (T, num_heads, head_dim), k/v (T, num_kv_heads, head_dim) for the step's tokens.
        Writes k/v into their slots (unless `rope_and_write` did), returns attention output
        (T, num_heads * head_dim)."""

    def rope_and_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
                       metadata: Any, num_heads: int,
                       qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """q and k after RoPE (T, num_heads + num_kv_heads, head_dim) from the qkv matmul's output,
        with `qk_norms` (q weight, k weight, eps) each head RMS-normed first, and k and v written
        to their slots, in one call where the backend has a kernel for it; None where it has not
        (the layer norms and applies RoPE, `forward` writes)."""
        return None

    def decode_stack_args(self, metadata: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Per KV group (slot_mapping, block_tables, seq_lens) when every token of the step is a
        single-token decode that the C++ CPU kernels can take (engine/csrc/decode_stack.cpp runs
        the whole stack then); None otherwise, and for backends without them."""
        return None

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        window: int | None) -> Any:
        """One KV group's metadata of a decode-only step (one query per sequence) that reads only
        these tensors, int32 block tables and context lengths, so a CUDA graph can replay it over
        new values; for backends with `captures_decodes`."""
        raise NotImplementedError(f"the {self.name} backend builds its metadata per step")


def scratch_cache(backend: AttentionBackend, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A cache for one sequence of up to `num_blocks` blocks in every KV group of `model`
    (ModelInputs.one_sequence's tables)."""
    layout = model.kv_layout
    return backend.allocate_kv_cache(layout.num_slots, layout.num_groups * num_blocks, block_size, model.num_kv_heads,
                                     model.head_dim, dtype, device)


class BlockMajorCache:
    """The CUDA backends' cache layout: per cache slot (2, num_blocks, block_size, num_kv_heads,
    head_dim), each token slot's heads contiguous, so a token slot is one index of the flattened
    (2, slots, heads, dim)."""

    def allocate_kv_cache(self, num_slots, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        return zeroed_pool((num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)

    def block_dim(self) -> int:
        return 2

    @staticmethod
    def write_kv(layer_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v (T, num_kv_heads, head_dim) into their slots."""
        flat = layer_cache.view(2, -1, *layer_cache.shape[-2:])
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)
