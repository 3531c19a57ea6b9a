"""Which attention backend runs, and the KV cache's dtype and size per block: decided once, at
engine start, from the device, the model's dtype and the config."""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionParams

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
    """KV bytes of one block of the model (K and V), in each of its cache slots (KVLayout)."""
    return 2 * model.kv_layout.num_slots * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401  (CUDA builds of torch ship it)
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device, dtype: torch.dtype, params: AttentionParams,
                   max_model_len: int | None = None) -> AttentionBackend:
    """`auto` on CUDA in bf16/fp16: the Triton kernel over the paged cache, else torch's flash
    attention over gathered contexts (no Triton, no soft-cap), else pure torch; in float32 on
    CUDA pure torch (transformers' parity); on CPU in float32: torch with the C++ decode kernel
    when it builds, else pure torch. `torch` forces the pure-torch path, `cpu` requires the
    kernel, `flash` requires CUDA, a 16-bit dtype and no soft-cap, `triton` CUDA (float32 too:
    CUDA graphs in float32) and the longest context, `max_model_len` (it sizes the kernel's
    decode partitions)."""
    if name == "triton" or (name == "auto" and dtype in FLASH_DTYPES and triton_available(device)):
        if not triton_available(device):
            raise ValueError(f"attention_backend 'triton' needs a CUDA device and Triton, got {device.type}")
        if max_model_len is None:
            raise ValueError("attention_backend 'triton' needs max_model_len")
        from engine.attention.triton_paged import TritonPagedBackend
        return TritonPagedBackend(params, max_model_len)
    if name == "flash" or (name == "auto" and flash_available(device, dtype) and params.softcap is None):
        if not flash_available(device, dtype):
            raise ValueError(f"attention_backend 'flash' needs a CUDA device with flash attention and dtype "
                             f"bfloat16 or float16, got {device.type} and {dtype}")
        if params.softcap is not None:
            raise ValueError("attention_backend 'flash' has no score soft-cap, which this model uses; "
                             "use 'triton' or 'torch'")
        from engine.attention.flash import FlashAttentionBackend
        return FlashAttentionBackend(params)
    from engine.attention.torch_backend import TorchAttentionBackend
    kernel = None
    if name in ("auto", "cpu") and device.type == "cpu" and dtype == torch.float32:
        from engine.cpu_kernels import load_cpu_kernels
        kernel = load_cpu_kernels()
    if name == "cpu" and dtype != torch.float32:
        raise ValueError("attention_backend 'cpu' needs dtype float32")
    if name == "cpu" and kernel is None:
        raise ValueError("attention_backend 'cpu' needs the C++ decode kernel, which could not be built here")
    return TorchAttentionBackend(params, kernel)
