"""Moves KV blocks for the scheduler's decisions: swap out to the host pool, swap in from it, and
copy-on-write copies on the device, in that order, before the step's forward.

On the CPU these are index copies. On CUDA the host transfers never touch pageable memory and
never stall the step: blocks bound for the host are gathered on the device (before the forward
can overwrite them), copied into a pinned staging buffer on a side stream while the forward runs,
and scattered into the host pool at the next step's start, after the copy's event; blocks coming
back are gathered on the host into pinned staging and copied up on the side stream as the step
starts, while the CPU prepares its inputs, and the compute stream waits for that copy's event
before it scatters them into the cache.
"""
from __future__ import annotations

import torch

from engine.scheduler.output import SchedulerOutput


def _indices(pairs: list[tuple[int, int]], which: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([p[which] for p in pairs], dtype=torch.long, device=device)


class BlockMover:
    def __init__(self, kv_cache: torch.Tensor, host_cache: torch.Tensor, dim: int):
        """`dim`: the caches' block dimension (AttentionBackend.block_dim)."""
        self.kv_cache, self.host_cache, self.dim = kv_cache, host_cache, dim
        self.cuda = kv_cache.device.type == "cuda"
        if self.cuda:
            self.side = torch.cuda.Stream(kv_cache.device)
            self._staging = {"out": torch.empty(0, dtype=kv_cache.dtype), "in": torch.empty(0, dtype=kv_cache.dtype)}
            self._in_flight: dict[str, torch.cuda.Event] = {}
            self._pending_out: tuple[torch.Tensor, torch.Tensor] | None = None  # (host blocks, staged values)

    def move(self, out: SchedulerOutput) -> None:
        if not self.cuda:
            for pairs, src_cache, dst_cache in ((out.blocks_to_swap_out, self.kv_cache, self.host_cache),
                                                (out.blocks_to_swap_in, self.host_cache, self.kv_cache),
                                                (out.blocks_to_copy, self.kv_cache, self.kv_cache)):
                if pairs:
                    dst_cache.index_copy_(self.dim, _indices(pairs, 1, dst_cache.device),
                                          src_cache.index_select(self.dim, _indices(pairs, 0, src_cache.device)))
            return
        self.finish_swap_out()
        if out.blocks_to_swap_out:
            self._swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self._swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            pairs, device = out.blocks_to_copy, self.kv_cache.device
            self.kv_cache.index_copy_(self.dim, _indices(pairs, 1, device),
                                      self.kv_cache.index_select(self.dim, _indices(pairs, 0, device)))

    def finish_swap_out(self) -> None:
        """Scatters the last swap-out into the host pool once its copy has landed."""
        if self._pending_out is None:
            return
        host_blocks, staged = self._pending_out
        self._in_flight.pop("out").synchronize()
        self.host_cache.index_copy_(self.dim, host_blocks, staged)
        self._pending_out = None

    def _stage(self, kind: str, shape: torch.Size) -> torch.Tensor:
        """A pinned host buffer of `shape`, reused across steps once its last copy is done."""
        event = self._in_flight.pop(kind, None)
        if event is not None:
            event.synchronize()
        numel = shape.numel()
        if self._staging[kind].numel() < numel:
            self._staging[kind] = torch.empty(max(numel, 2 * self._staging[kind].numel()), dtype=self.kv_cache.dtype,
                                              pin_memory=True)
        return self._staging[kind][:numel].view(shape)

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        staged = self.kv_cache.index_select(self.dim, _indices(pairs, 0, self.kv_cache.device))
        host = self._stage("out", staged.shape)
        self.side.wait_stream(torch.cuda.current_stream())  # the gather is done before the copy reads it
        with torch.cuda.stream(self.side):
            host.copy_(staged, non_blocking=True)
            self._in_flight["out"] = torch.cuda.Event()
            self._in_flight["out"].record()
        staged.record_stream(self.side)
        self._pending_out = (_indices(pairs, 1, torch.device("cpu")), host)

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        src = _indices(pairs, 0, torch.device("cpu"))
        shape = list(self.host_cache.shape)
        shape[self.dim] = len(pairs)
        host = self._stage("in", torch.Size(shape))
        torch.index_select(self.host_cache, self.dim, src, out=host)
        with torch.cuda.stream(self.side):
            staged = host.to(self.kv_cache.device, non_blocking=True)
            self._in_flight["in"] = torch.cuda.Event()
            self._in_flight["in"].record()
        compute = torch.cuda.current_stream()
        compute.wait_event(self._in_flight["in"])
        staged.record_stream(compute)
        self.kv_cache.index_copy_(self.dim, _indices(pairs, 1, self.kv_cache.device), staged)
