"""The attention backend interface (engine/attention/selector.py chooses one at engine start).

A backend owns the KV cache layout and the per-step attention metadata; the model only calls
`forward(q, k, v, layer_cache, metadata)`.
"""
from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.batch import ModelInputs


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


class AttentionBackend(ABC):
    name: str
    captures_decodes = False  # decode_metadata reads fixed buffers: decode steps can replay CUDA graphs

    @abstractmethod
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One tensor for all layers; `cache[layer]` is what `forward` receives."""

    @abstractmethod
    def block_dim(self) -> int:
        """The dimension of the whole cache tensor that indexes blocks (swap and copy act on it)."""

    @abstractmethod
    def build_metadata(self, inputs: ModelInputs) -> Any:
        """Per-step tensors shared by all layers (masks, gather indices); built once per step."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                metadata: Any, kv_written: bool = False) -> torch.Tensor:
        """q (T, num_heads, head_dim), k/v (T, num_kv_heads, head_dim) for the step's tokens.
        Writes k/v into their slots (unless `rope_and_write` did), returns attention output
        (T, num_heads * head_dim)."""

    def rope_and_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
                       metadata: Any, num_heads: int) -> torch.Tensor | None:
        """q and k after RoPE (T, num_heads + num_kv_heads, head_dim) from the qkv matmul's output,
        with k and v written to their slots, in one call where the backend has a kernel for it;
        None where it has not (the layer applies RoPE, `forward` writes)."""
        return None

    def decode_stack_args(self, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
        """(slot_mapping, block_tables, seq_lens, scale) when every token of the step is a
        single-token decode that the C++ CPU kernels can take (engine/csrc/decode_stack.cpp runs
        the whole stack then); None otherwise, and for backends without them."""
        return None

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        """Metadata of a decode-only step (one query per sequence) that reads only these tensors,
        int32 block tables and context lengths, so a CUDA graph can replay it over new values;
        for backends with `captures_decodes`."""
        raise NotImplementedError(f"the {self.name} backend builds its metadata per step")


class BlockMajorCache:
    """The CUDA backends' cache layout: per layer (2, num_blocks, block_size, num_kv_heads, head_dim),
    each slot's heads contiguous, so a slot is one index of the flattened (2, slots, heads, dim)."""

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        return zeroed_pool((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)

    def block_dim(self) -> int:
        return 2

    @staticmethod
    def write_kv(layer_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v (T, num_kv_heads, head_dim) into their slots."""
        flat = layer_cache.view(2, -1, *layer_cache.shape[-2:])
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)
