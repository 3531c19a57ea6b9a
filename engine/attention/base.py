"""The attention backend interface and its run-time selection.

A backend owns the KV cache layout and the per-step attention metadata; the model only calls
`forward(q, k, v, layer_cache, metadata)`. Selection happens once, at engine start.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.runner.inputs import ModelInputs


class AttentionBackend(ABC):
    name: str

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


FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in FLASH_DTYPES and torch.backends.cuda.is_flash_attention_available()


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """CacheConfig.kv_cache_dtype made concrete. A CPU cache may be fp16 under an fp32 model (both
    CPU attention paths read it as fp32); on CUDA the flash kernels take q and the cache in one
    dtype, so the cache keeps the model's."""
    dtype = model_dtype if name == "auto" else getattr(torch, name)
    if device.type == "cuda" and dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype {name!r} on CUDA: the cache keeps the model's dtype ({model_dtype}); "
                         "use 'auto'")
    return dtype


def kv_block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes of one block of the model across all layers (K and V)."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize


def select_backend(name: str, device: torch.device, dtype: torch.dtype, scale: float) -> AttentionBackend:
    """`auto`: flash attention on CUDA in bf16/fp16; on CPU in float32 torch with the C++ decode
    kernel when it builds; else pure torch. `torch` forces the pure-torch path, `cpu` requires
    the kernel, `flash` requires CUDA and a 16-bit dtype."""
    if name == "flash" or (name == "auto" and flash_available(device, dtype)):
        if not flash_available(device, dtype):
            raise ValueError(f"attention_backend 'flash' needs a CUDA device with flash attention and dtype "
                             f"bfloat16 or float16, got {device.type} and {dtype}")
        from engine.attention.flash import FlashAttentionBackend
        return FlashAttentionBackend(scale)
    from engine.attention.torch_backend import TorchAttentionBackend
    kernel = None
    if name in ("auto", "cpu") and device.type == "cpu" and dtype == torch.float32:
        from engine.cpu_kernels import load_cpu_kernels
        kernel = load_cpu_kernels()
    if name == "cpu" and dtype != torch.float32:
        raise ValueError("attention_backend 'cpu' needs dtype float32")
    if name == "cpu" and kernel is None:
        raise ValueError("attention_backend 'cpu' needs the C++ decode kernel, which could not be built here")
    return TorchAttentionBackend(scale, kernel)
