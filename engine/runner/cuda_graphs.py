"""Decode-only steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start.

A decode step of a small model is bound by launching each layer's kernels from Python, not by the
GPU (the weights take microseconds to read); a graph launches the whole forward at once. Each
bucket's graph reads fixed buffers (token ids, positions, each KV group's slots and block
tables, context lengths), so a step copies its inputs in, pads to the bucket, and replays. Padding rows attend to
one token of a sink block that no request owns and write their keys there. Steps with a prefill
chunk, or more rows than the largest bucket, run eagerly.

The graphs share one memory pool and are captured largest first: each smaller graph's
temporaries fit in the blocks the larger ones freed, and every graph writes its logits into one
buffer of the largest bucket's rows, so the pool holds about one graph's memory, not the sum of
all (smallest first, each larger graph needs blocks of its own); the warm-up forward before each
capture runs on one stream, whose freed blocks the next warm-up reuses. A bucket whose capture
takes the memory past `memory_bytes` is dropped; while none is kept the pool starts afresh, so
the next smaller bucket is measured alone.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from engine.batch import ModelInputs, host_tensor, padded_rows

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple  # tensors the graph reads besides the shared buffers: alive as long as it is


def default_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every 8, up to max_num_seqs (and at most 512)."""
    limit = min(max_num_seqs, 512)
    return sorted({s for s in (1, 2, 4, *range(8, limit + 1, 8), limit) if s <= limit})


@dataclass(frozen=True, slots=True)
class GraphSettings:
    sizes: list[int]  # batch sizes (decode rows) captured
    memory_bytes: int  # the most the graphs' memory pool may take
    max_model_len: int  # block tables are this long


class DecodeGraphs:
    def __init__(self, model, backend, kv_cache: torch.Tensor, sink_block: int, block_size: int,
                 settings: GraphSettings):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.sink_block, self.block_size = sink_block, block_size
        device, largest, memory_bytes = kv_cache.device, max(settings.sizes), settings.memory_bytes
        width = -(-settings.max_model_len // block_size)
        self.windows = model.kv_layout.windows
        groups = len(self.windows)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((groups, largest), sink_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((groups, largest, width), sink_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None  # (largest, vocab): each replay writes its rows' logits here
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup_stream = torch.cuda.Stream(device)  # one for all: each warm-up reuses the blocks the last freed
        start = torch.cuda.memory_reserved(device)
        for size in sorted(settings.sizes, reverse=True):
            captured = self._capture(size)
            used = torch.cuda.memory_reserved(device) - start
            if used <= memory_bytes:
                self.graphs[size] = captured
                continue
            logger.info("CUDA graphs: bucket %d would take the graphs' memory to %.0f MiB, over the cap of %.0f MiB; "
                        "its decode steps run in a larger bucket's graph or eagerly", size, used / 2**20,
                        memory_bytes / 2**20)
            del captured
            if not self.graphs:  # the pool holds only what the dropped graph freed: give it back
                self.pool = torch.cuda.graph_pool_handle()
                torch.cuda.empty_cache()
                start = torch.cuda.memory_reserved(device) - (0 if self.logits is None else self.logits.nbytes)
        self.sizes = sorted(self.graphs)
        self.memory_bytes = torch.cuda.memory_reserved(device) - start  # what the kept graphs hold
        logger.info("CUDA graphs: %d decode buckets of %s rows captured in %.0f MiB", len(self.sizes),
                    f"{self.sizes[0]}-{self.sizes[-1]}" if self.sizes else "no", self.memory_bytes / 2**20)
        self.replays = 0  # decode steps run from a graph

    def _capture(self, size: int) -> _Graph:
        metadata = [self.backend.decode_metadata(self.slot_mapping[g, :size], self.block_tables[g, :size],
                                                 self.seq_lens[:size], window) for g, window in enumerate(self.windows)]
        rows = torch.arange(size, device=self.kv_cache.device)

        def forward():
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self.backend, metadata,
                              rows)

        stream = self.warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            logits = forward()  # warm-up outside the graph: kernels compiled and autotuned, workspaces made
        torch.cuda.current_stream().wait_stream(stream)
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        del logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            self.logits[:size].copy_(forward())
        return _Graph(graph, (metadata, rows))

    def bucket(self, inputs: ModelInputs) -> int | None:
        """The smallest captured size holding this step, if it is decode-only and fits one."""
        num_tokens = inputs.input_ids.shape[0]
        if inputs.num_decodes != num_tokens or inputs.scored_indices or not self.sizes:
            return None
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Logits (T, vocab) of every row of a decode-only step, from the graph of `size`."""
        n, groups = inputs.input_ids.shape[0], inputs.kv_groups
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        for g, group in enumerate(groups):
            self.slot_mapping[g, :n].copy_(group.slot_mapping)
        width = max(len(table) for group in groups for table in group.block_tables)
        # block tables and context lengths go up from pinned memory of their own, without waiting for
        # the step before (still running, under async scheduling); padding rows attend the sink block.
        # Only the step's width: a row's entries past its context are never read, so what an earlier
        # step left there stays (a whole row is max_model_len / block_size entries: 8 MB at 256 rows of 128k)
        tables = torch.full((len(groups), size, width), self.sink_block, dtype=torch.int32, pin_memory=True)
        for g, group in enumerate(groups):
            tables[g, :n] = padded_rows(group.block_tables, self.sink_block, torch.int32, width)
        lens = torch.ones(size, dtype=torch.int32, pin_memory=True)
        lens[:n] = host_tensor(inputs.seq_lens, torch.int32)
        if n < size:  # padding: token 0 at position 0, one key in the sink block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[:, n:size].fill_(self.sink_block * self.block_size)
        self.block_tables[:, :size, :width].copy_(tables, non_blocking=True)
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        self.graphs[size].graph.replay()
        self.replays += 1
        assert self.logits is not None  # made with the first graph
        return self.logits[:n]
