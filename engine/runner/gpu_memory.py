"""The KV pool sized from the GPU, as vLLM's `gpu_memory_utilization`: of the card's memory, that
fraction is this engine's; the weights (and whatever else already holds memory), the peak of the
largest step this engine can schedule (measured by running one) and the CUDA graphs' cap come
off it, and the rest holds KV blocks."""
from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, scratch_cache
from engine.batch import ModelInputs

logger = logging.getLogger(__name__)


@torch.inference_mode()
def peak_step_bytes(model, backend: AttentionBackend, device: torch.device, kv_dtype: torch.dtype,
                    block_size: int, num_tokens: int, num_sampled: int) -> int:
    """Memory a step of `num_tokens` prompt tokens with `num_sampled` logits rows takes at its
    peak beyond what is allocated before it (activations, attention workspaces, logits and the
    sampler's float32 copies), measured by running one over a scratch cache."""
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = scratch_cache(backend, model, num_blocks, block_size, kv_dtype, device)
    cache_bytes = cache.numel() * cache.element_size()
    rows = torch.arange(num_tokens - num_sampled, num_tokens, device=device)
    inputs = ModelInputs.one_sequence(torch.zeros(num_tokens, dtype=torch.long, device=device), 0, num_blocks,
                                      block_size, rows, model.kv_layout)
    logits = model(inputs.input_ids, inputs.positions, cache, backend, backend.build_metadata(inputs), rows)
    torch.log_softmax(logits.float(), dim=-1).exp_()  # the sampler's float32 logprobs and probabilities
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    del cache, logits
    torch.cuda.empty_cache()
    return peak


def kv_pool_bytes(device: torch.device, utilization: float, peak_bytes: int, reserved_bytes: int) -> int:
    """Bytes left for KV blocks: `utilization` of the card, less what is in use now (this
    process's weights, the CUDA context, other processes), the profiled step peak and
    `reserved_bytes` (the CUDA graphs' cap)."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - peak_bytes - reserved_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: of "
                         f"{total / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB are in use, a peak step takes "
                         f"{peak_bytes / 2**30:.2f} GiB and the CUDA graphs up to {reserved_bytes / 2**30:.2f} GiB")
    return budget
