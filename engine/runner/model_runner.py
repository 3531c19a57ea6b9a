"""Executes one scheduled step: block swaps and copies, the ragged forward, sampling.

Owns the device KV cache and its host swap mirror, and on CUDA the decode steps' graphs; makes no
scheduling decisions. A step is launched (its work queued on the device) and then collected: the
step waits for the GPU once, when the sampler's tokens and logprobs come back together. Under
async scheduling the next step is launched before this one is collected, its input tokens read
on the device from this one's samples. On CUDA it runs one step of its own at start-up, so
kernels compiled on first use (Triton's) are compiled before the first request, not while a
batch waits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.attention.base import AttentionBackend
from engine.attention.selector import triton_available
from engine.batch import GroupTables, ModelInputs
from engine.models.paged_model import PagedModel
from engine.outputs import ModelRunnerOutput
from engine.runner.block_mover import BlockMover
from engine.runner.cuda_graphs import DecodeGraphs, GraphSettings
from engine.runner.inputs import build_inputs, to_device
from engine.runner.speculation.draft_model import DraftModelDrafter
from engine.runner.speculation.self_draft import SelfDraft
from engine.runner.speculation.verify import accepted_tokens
from engine.sampler import SampledBatch, Sampler
from engine.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, until it is collected."""
    out: SchedulerOutput
    inputs: ModelInputs | None = None  # None: nothing was scheduled
    logits: torch.Tensor | None = None  # (R + scored prompt positions, vocab)
    sampled: SampledBatch | None = None  # None: no row samples (the step computes embeddings' prompts only)
    pooled: torch.Tensor | None = None  # (pooled positions, hidden): final hidden states, for embeddings
    draft_passes: int = 0
    draft_seconds: float = 0.0
    drafts_unfilled: bool = False
    catch_up_tokens: int = 0

    def next_input_ids(self, inputs: ModelInputs) -> torch.Tensor:
        """The input tokens of a step scheduled ahead of this one (each row a request this step
        samples for), gathered on the device from this step's samples."""
        if self.inputs is None or self.sampled is None:
            raise ValueError("a step ahead follows a step that sampled")
        row_of = {request.request_id: row for request, _, row in self.inputs.verified}
        rows = [row_of[request.request_id] for request in inputs.sampled_requests]
        return self.sampled.token_ids[to_device(rows, self.sampled.token_ids.device)]


@dataclass(frozen=True)
class KVPools:
    """The KV cache's blocks: on the device and, for swapped requests, in host memory."""
    num_blocks: int
    num_host_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32


class ModelRunner:
    def __init__(self, model: PagedModel, backend: AttentionBackend, pools: KVPools, device: torch.device, seed: int,
                 *, drafter: SelfDraft | DraftModelDrafter | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), graphs: GraphSettings | None = None):
        """`drafter`: fills in the drafts the scheduler reserved, before the target's forward;
        `eos_token_ids`: the model's (the sampler keeps them from ending an output before min_tokens);
        `graphs`: capture decode steps in CUDA graphs, where the backend's decode metadata allows."""
        num_blocks, num_host_blocks, block_size, kv_cache_dtype = (pools.num_blocks, pools.num_host_blocks,
                                                                   pools.block_size, pools.dtype)
        self.model = model
        self.drafter = drafter
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.windows = model.kv_layout.windows
        # on CUDA one block more than the scheduler hands out: the graphs' padding rows write there
        shape = (model.kv_layout.num_slots, num_blocks + (device.type == "cuda"), block_size, model.num_kv_heads,
                 model.head_dim)
        self.kv_cache = backend.allocate_kv_cache(*shape, dtype=kv_cache_dtype, device=device)
        host_shape = (model.kv_layout.num_slots, max(num_host_blocks, 1), *shape[2:])
        self.host_cache = backend.allocate_kv_cache(*host_shape, dtype=kv_cache_dtype, device=torch.device("cpu"))
        if device.type == "cuda":
            self.host_cache = self.host_cache.pin_memory()
        self.blocks = BlockMover(self.kv_cache, self.host_cache, backend.block_dim())
        self.sampler = Sampler(seed, device, eos_token_ids)
        self._pool_sums: dict[str, tuple[torch.Tensor, int]] = {}  # mean pooling: each prompt's sum so far
        self.graphs = None
        if graphs is not None and device.type == "cuda" and backend.captures_decodes:
            self.graphs = DecodeGraphs(model, backend, self.kv_cache, num_blocks, block_size, graphs)
        if device.type == "cuda":
            self._warm_up(sink_block=num_blocks)

    @torch.inference_mode()
    def _warm_up(self, sink_block: int) -> None:
        """An eager step of a decode beside a two-token prefill chunk, writing only the block no
        request owns: each Triton kernel an eager step launches is compiled now."""
        device, size = self.device, self.block_size

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        positions = [0, 0, 1]  # the decode's token, then the chunk's two
        slots = longs([sink_block * size + p % size for p in positions])
        groups = [GroupTables(window, slots, [[sink_block], [sink_block] * 2]) for window in self.windows]
        inputs = ModelInputs(longs([0, 0, 0]), longs(positions), groups, query_start_loc=[0, 1, 3], seq_lens=[1, 2],
                             start_positions=[0, 0], num_decodes=1, block_size=size, sample_indices=longs([0, 2]),
                             sampled_requests=[], sampled_drafts=[], verified=[])
        t0 = time.perf_counter()
        self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                   self.backend.build_metadata(inputs), inputs.sample_indices)
        torch.cuda.synchronize(device)
        variants = (f": {triton_variants()} Triton kernel variants compiled or loaded" if triton_available(device)
                    else "")
        logger.info("kernels warmed up in %.1f s%s", time.perf_counter() - t0, variants)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queues the step's block moves, forward and sampling. `previous`: the step launched
        before this one and not yet collected, whose samples are this step's input tokens (the
        scheduler's placeholders: every row of `out` continues a request `previous` samples for)."""
        self.sampler.forget(out.finished_ids)
        for request_id in out.finished_ids:
            self._pool_sums.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(out.finished_ids)
        self.blocks.move(out)
        step = LaunchedStep(out)
        if out.is_empty:
            return step
        if self.drafter is not None and any(item.draft_token_ids for item in out.scheduled):
            t0 = time.perf_counter()
            step.draft_passes, step.catch_up_tokens = self.drafter.fill(out.scheduled, self.kv_cache, self.backend)
            step.draft_seconds = time.perf_counter() - t0
            step.drafts_unfilled = not any(item.draft_token_ids for item in out.scheduled)
        inputs = step.inputs = build_inputs(out.scheduled, self.block_size, self.device, self.windows)
        if previous is not None:
            inputs.input_ids = previous.next_input_ids(inputs)
        graphs = self.graphs if not inputs.pooled and not inputs.lora else None
        size = graphs.bucket(inputs) if graphs is not None else None
        if graphs is not None and size is not None:
            logits = graphs.run(inputs, size)
            if len(inputs.sample_indices) < logits.shape[0]:  # increasing indices: as many as rows is every row
                logits = logits[inputs.sample_indices]
        else:
            metadata = self.backend.build_metadata(inputs)
            indices = inputs.sample_indices
            if inputs.scored_indices:
                indices = torch.cat([indices, torch.tensor(inputs.scored_indices, dtype=torch.long,
                                                           device=self.device)])
            adapters = {} if inputs.lora is None else {"loras": inputs.lora}  # only native models take them
            if inputs.pooled:
                logits, step.pooled = self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                                                 metadata, indices,
                                                 pooled_indices=to_device(inputs.pooled_indices, self.device),
                                                 **adapters)
            else:
                logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend, metadata,
                                    indices, **adapters)
        step.logits = logits
        if inputs.sampled_requests:
            step.sampled = self.sampler.launch(logits[:len(inputs.sample_indices)], inputs.sampled_requests,
                                               inputs.sampled_drafts)
        return step

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Waits for the step's samples: the accepted tokens and logprobs of each request."""
        inputs = step.inputs
        if inputs is None:
            return ModelRunnerOutput({}, {})
        pooled = self._pool(inputs.pooled, step.pooled) if inputs.pooled and step.pooled is not None else {}
        num_sampled = len(inputs.sample_indices)
        prompt_logprobs = {} if step.logits is None else _prompt_logprobs(step.logits[num_sampled:],
                                                                          inputs.scored_prompts)
        if step.sampled is None:  # prompt chunks only
            return ModelRunnerOutput({}, {}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        result = step.sampled.result()
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        token_ids, errors = result.token_ids, result.errors
        for request, drafts, row in inputs.verified:
            if errors and request.request_id in errors:
                continue
            row_tokens = _sampled(token_ids[row:row + len(drafts) + 1])
            tokens = accepted_tokens(row_tokens, drafts) if drafts else row_tokens[:1]
            sampled[request.request_id] = tokens
            if request.params.keeps_logprobs:
                logprobs[request.request_id] = _sampled(result.logprobs[row:row + len(tokens)])
        return ModelRunnerOutput(sampled, logprobs, result.errors, step.draft_passes, step.draft_seconds,
                                 step.drafts_unfilled, step.catch_up_tokens, prompt_logprobs, pooled)

    def _pool(self, pooled: list, hidden: torch.Tensor) -> dict[str, list[float]]:
        """The embeddings of the requests whose prompt this step ends: the last token's hidden state,
        or the mean of all of them (summed over the chunks of earlier steps; a chunk at position 0
        starts the sum over, as after a recomputing preemption), cut to `dimensions` and
        L2-normalised."""
        done = {}
        for request, first, count, start, ends in pooled:
            rows = hidden[first:first + count].float()
            vector = rows[-1]
            if request.pooling.pooling == "mean":
                total, num = self._pool_sums.pop(request.request_id, (0.0, 0))
                if start == 0:  # this chunk starts the prompt
                    total, num = 0.0, 0
                total, num = total + rows.sum(0), num + count
                if not ends:
                    self._pool_sums[request.request_id] = (total, num)
                    continue
                vector = total / num
            if request.pooling.dimensions is not None:
                vector = vector[:request.pooling.dimensions]
            done[request.request_id] = torch.nn.functional.normalize(vector, dim=0).tolist()
        return done


def _prompt_logprobs(logits: torch.Tensor, scored: list) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """Each scored request's prompt logprobs from its rows' logits: the next prompt token's and the
    top `prompt_logprobs` ones, after each position."""
    if not scored:
        return {}
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    result, row = {}, 0
    for request, first, count in scored:
        rows = logprobs[row:row + count]
        targets = torch.tensor(request.prompt_token_ids[first + 1:first + 1 + count], device=rows.device)
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        k = request.params.prompt_logprobs
        top_values, top_ids = rows.topk(k) if k else (rows[:, :0], rows[:, :0].long())
        result[request.request_id] = (first, [{t: lp} | dict(zip(ids, values)) for t, lp, ids, values in
                                              zip(targets.tolist(), chosen, top_ids.tolist(), top_values.tolist())])
        row += count
    return result


def triton_variants() -> int:
    """Variants of the engine's Triton kernels compiled so far in this process (or loaded from
    Triton's disk cache): one per kernel and value class of its specialized arguments."""
    from triton.runtime.jit import JITFunction

    from engine.attention import triton_paged
    from engine.models import cuda_ops
    kernels = [k for module in (triton_paged, cuda_ops) for k in vars(module).values() if isinstance(k, JITFunction)]
    return sum(len(compiled) for kernel in kernels for compiled, *_ in kernel.device_caches.values())


def _sampled(values: list[T | None]) -> list[T]:
    """A row's values: None only where its sampling failed (its request is skipped)."""
    if any(v is None for v in values):
        raise ValueError("a row that did not fail has no value")
    return [v for v in values if v is not None]
