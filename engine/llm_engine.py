"""The synchronous engine: add requests, step, get outputs. Tokenizer at the edges.

`step()` is schedule -> launch -> collect -> update -> outputs; everything else belongs to one
owner. Under async scheduling a steady batch of decodes has its next step scheduled and queued on
the device before this step's tokens are read, so the host's scheduling, input building, updates
and detokenization overlap the device's forward; the step in flight is collected by the next call.
A request that fails while running (its sampling, stop check or detokenization) fails alone:
its stream gets a RequestError and its blocks are freed, and the step goes on for the others.
A structured output's request waits outside the scheduler until its constraint is compiled
(on the compiler's thread), and a request whose LoRA adapter is not loaded until its files are
read (on the adapters' reader thread); the step loop goes on for the others meanwhile. A beam search runs
inside the step loop too (engine.beam_groups), its beams batched with every other request.
Not thread-safe: AsyncEngine drives it from one thread.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend
from engine.attention.selector import kv_block_bytes, resolve_kv_cache_dtype, select_backend
from engine.beam_groups import BeamGroups
from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.config import EngineConfig
from engine.drafts import DraftTransportFactory
from engine.errors import InvalidRequestError, RequestFailedError
from engine.gc_settings import freeze_startup_heap
from engine.grammar import GrammarCompiler, RequestGrammar
from engine.kv_cache.manager import KVCacheManager
from engine.lora import Adapters
from engine.metrics import EngineStats, ModelReport, StepStats
from engine.model_setup import LoadedModel, load_model
from engine.models.decoder import PagedDecoder
from engine.output_processor import OutputProcessor
from engine.outputs import RequestError, RequestOutput
from engine.request import FinishReason, Request
from engine.runner.cuda_graphs import GraphSettings, default_sizes
from engine.runner.gpu_memory import kv_pool_bytes, peak_step_bytes
from engine.runner.model_runner import KVPools, LaunchedStep, ModelRunner
from engine.runner.speculation.draft_model import DraftModelDrafter, load_draft_worker
from engine.runner.speculation.self_draft import SelfDraft
from engine.sampling_params import PoolingParams, SamplingParams
from engine.scheduler.scheduler import PreemptionCosts, Scheduler
from engine.tokenization import check_context_length, check_logit_bias, check_token_ids, encode_text

logger = logging.getLogger(__name__)
Event = RequestOutput | RequestError
COMPILE_WAIT_S = 0.01  # a step with nothing but compiling requests waits this long for one


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] = time.monotonic, draft_transport: DraftTransportFactory | None = None):
        """`loaded`: a model already loaded for `config.model` (several engines can share one);
        `clock`: the scheduler's time source (arrivals, aging, timings); `draft_transport`: where
        speculative placement `actor` sends its draft calls (the serve app's DraftModel)."""
        self.config = config
        self.clock = clock
        self.draft_transport = draft_transport
        if config.model.num_threads is not None:  # process-wide: the engine is the process's main work
            torch.set_num_threads(config.model.num_threads)
        self.loaded = loaded = loaded or load_model(config.model, config.cache.kv_cache_dtype)
        model, self.tokenizer = loaded.model, loaded.tokenizer
        self.chat_format = ChatOutputFormat.of(self.tokenizer, config.model.reasoning_parser,
                                               config.model.tool_call_parser)
        self.max_model_len = config.model.max_model_len or loaded.max_model_len
        if self.max_model_len > loaded.max_model_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the loaded model's {loaded.max_model_len}")
        self.vocab_size = model.vocab_size
        self.hidden_size = model.hidden_size
        self.eos_token_ids = loaded.eos_token_ids
        cache = config.cache
        device = torch.device(config.model.device)
        kv_dtype = (loaded.kv_cache_dtype if cache.kv_cache_dtype == "auto"  # as the loader resolved it
                    else resolve_kv_cache_dtype(cache.kv_cache_dtype, loaded.dtype, device))
        if kv_dtype != loaded.kv_cache_dtype:
            figures = {}  # scored through another cache (a model loaded for one engine, run by another)
        elif loaded.quality is not None:
            figures = {"top1_agreement": loaded.quality.top1_agreement,
                       "perplexity_increase": loaded.quality.perplexity_increase}
        elif loaded.quantization == "none" and loaded.dtype == kv_dtype == torch.float32:
            figures = {"top1_agreement": 1.0, "perplexity_increase": 0.0}  # the reference itself
        else:
            figures = {}  # not measured: the check off, a 16-bit dtype, or fp32 weights through an fp16 cache
        self.model_report = ModelReport(loaded.quantization, str(loaded.dtype).removeprefix("torch."),
                                        str(kv_dtype).removeprefix("torch."), config.model.device,
                                        loaded.weight_bytes_per_token, model.architecture, model.model_path,
                                        **figures)
        block_bytes = kv_block_bytes(model, cache.block_size, kv_dtype)
        backend = select_backend(config.model.attention_backend, device, loaded.dtype, model.attention,
                                 self.max_model_len)
        graphs = self._graph_settings(device)
        num_blocks = cache.num_blocks or self._pool_blocks(backend, device, kv_dtype, block_bytes, graphs)
        # the host pool holds swapped-out blocks: none under recompute-only preemption
        swaps = config.scheduler.preemption_mode != "recompute"
        num_host_blocks = cache.swap_space_bytes // block_bytes if swaps else 0
        self.kv = KVCacheManager(num_blocks, cache.block_size, num_host_blocks, cache.enable_prefix_caching,
                                 model.kv_layout)
        self.adapters = None
        if config.lora.enable_lora:
            if not isinstance(model, PagedDecoder):
                raise ValueError(f"LoRA adapters run on the native families; {model.architecture} runs through "
                                 "transformers' modeling code")
            dtype = config.lora.lora_dtype
            if dtype == "auto":
                dtype = "float32" if loaded.quantization == "none" and loaded.dtype == torch.float32 else "bfloat16"
            self.adapters = Adapters(model, config.lora, getattr(torch, dtype))
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, loaded.eos_token_ids,
                                   PreemptionCosts(block_bytes), clock, config.speculative, config.lora.max_loras,
                                   self.adapters.release if self.adapters is not None else None)
        pools = KVPools(num_blocks, num_host_blocks, cache.block_size, kv_dtype)
        self.runner = ModelRunner(model, backend, pools, device, config.model.seed, drafter=self._drafter(num_blocks),
                                  eos_token_ids=loaded.eos_token_ids, graphs=graphs)
        self.output_processor = OutputProcessor(self.tokenizer, clock)
        self.beams = BeamGroups(self.scheduler, self.tokenizer, loaded.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, loaded.eos_token_ids)
        # requests waiting for their constraint to compile and their adapter to load: (request, grammar
        # future or None, adapter name and future or None)
        self._pending: dict[str, tuple[Request, Future | None, tuple[str, Future] | None]] = {}
        self._last_step = StepStats()
        async_scheduling = config.scheduler.async_scheduling
        self.runs_ahead = device.type == "cuda" if async_scheduling is None else async_scheduling
        self._ahead: LaunchedStep | None = None  # the step launched before the last one was collected
        freeze_startup_heap()

    def _graph_settings(self, device: torch.device) -> GraphSettings | None:
        model = self.config.model
        if device.type != "cuda" or model.enforce_eager:
            return None
        sizes = model.cuda_graph_sizes or default_sizes(self.config.scheduler.max_num_seqs)
        return GraphSettings(sizes, model.cuda_graph_memory_bytes, self.max_model_len)

    def _pool_blocks(self, backend: AttentionBackend, device: torch.device, kv_dtype: torch.dtype, block_bytes: int,
                     graphs: GraphSettings | None) -> int:
        """KV blocks in kv_cache_memory_bytes, or on CUDA by default in what gpu_memory_utilization
        leaves, on the CPU in cpu_memory_utilization of the memory the weights left; never more than
        max_num_seqs requests of max_model_len tokens can fill."""
        cache, scheduler = self.config.cache, self.config.scheduler
        useful_blocks = scheduler.max_num_seqs * self.loaded.model.kv_layout.peak_blocks(
            self.max_model_len, cache.block_size, scheduler.max_num_batched_tokens)
        if cache.kv_cache_memory_bytes is None and device.type == "cuda":
            num_tokens = min(scheduler.max_num_batched_tokens, self.max_model_len)
            peak = peak_step_bytes(self.loaded.model, backend, device, kv_dtype, cache.block_size, num_tokens,
                                   min(scheduler.max_num_seqs, num_tokens))
            pool_bytes = kv_pool_bytes(device, cache.gpu_memory_utilization, peak, graphs.memory_bytes if graphs else 0)
        elif cache.kv_cache_memory_bytes is None and cache.cpu_memory_utilization is not None:
            pool_bytes = int(cache.cpu_memory_utilization * host_memory_available())
        else:
            pool_bytes = cache.kv_cache_bytes
        num_blocks = min(pool_bytes // block_bytes, useful_blocks)
        if num_blocks < 1:
            raise ValueError(f"a KV pool of {pool_bytes} bytes holds no {block_bytes}-byte block")
        logger.info("KV cache on %s: %d blocks of %d tokens, %.2f GiB (of %.2f GiB available); at most %.1f "
                    "requests of %d tokens at once", device, num_blocks, cache.block_size,
                    num_blocks * block_bytes / 2**30, pool_bytes / 2**30,
                    num_blocks * cache.block_size / self.max_model_len, self.max_model_len)
        return num_blocks

    def _drafter(self, num_blocks: int) -> SelfDraft | DraftModelDrafter | None:
        """What fills the drafts the scheduler reserves (n-gram drafts need nothing): the target's
        own first layers, or a draft model here or behind the draft transport."""
        spec, block_size = self.config.speculative, self.config.cache.block_size
        if spec is None or not spec.uses_draft_model:
            return None
        if spec.placement == "actor":
            if self.draft_transport is None:
                raise ValueError("speculative placement 'actor' needs a draft transport: the serve app's "
                                 "DraftModel deployment (serve_app.draft), or one given as draft_transport")
            return DraftModelDrafter(self.draft_transport())
        if spec.method == "self_draft":
            return SelfDraft(self.loaded.model, spec.num_layers, block_size, self.config.model.seed)
        worker = load_draft_worker(spec, self.config.model, self.max_model_len, block_size,
                                   self.config.cache.kv_cache_bytes, num_blocks,
                                   (self.tokenizer, self.vocab_size))
        return DraftModelDrafter(worker.propose)

    @classmethod
    def from_engine_args(cls, model: str | None = None, draft_transport: DraftTransportFactory | None = None,
                         **engine_args) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args), draft_transport=draft_transport)

    # ---- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenizes and validates a prompt; raises InvalidRequestError naming the problem."""
        token_ids = encode_text(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        check_token_ids(token_ids, self.vocab_size)
        check_context_length(len(token_ids), None, self.max_model_len)
        return token_ids

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | BeamSearchParams | PoolingParams, priority: int = 0,
                    waited_s: float = 0.0, lora: str | None = None) -> None:
        """Queues a request, with BeamSearchParams a beam search, or with PoolingParams an
        embedding (validated first: ValueError leaves the engine unchanged). `waited_s`: time it
        already waited upstream (a router's queue): it arrived that much earlier, so its aging
        goes on from there instead of starting over. `lora`: the name of the LoRA adapter it runs
        with (engine.lora.AdapterNotFoundError where none has it)."""
        if self.output_processor.has_request(request_id) or request_id in self.beams:
            raise InvalidRequestError(None, f"request_id {request_id!r} is already in use")
        adapters = self.adapters
        if lora is not None and adapters is None:
            raise InvalidRequestError("model", f"adapter {lora!r}: LoRA adapters are not enabled (enable_lora)")
        if isinstance(params, BeamSearchParams):
            installed = None
            if lora is not None and adapters is not None:  # a search's beams are made at once: its adapter first
                installed = adapters.install(lora, adapters.acquire(lora))
                if installed is None:
                    raise InvalidRequestError("model", f"adapter {lora!r}: every adapter slot runs requests; "
                                                       "retry when one ends")
            self.beams.add(request_id, self.encode_prompt(prompt), params, priority, self.clock() - waited_s, installed)
            return
        pooling = None
        if isinstance(params, PoolingParams):
            pooling = self._pooling(params)
            params = SamplingParams(max_tokens=1, temperature=0)  # scheduled as a prompt, never sampled from
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(None, f"params must be a SamplingParams, BeamSearchParams or PoolingParams, got "
                                            f"{type(params).__name__}")
        token_ids = self.encode_prompt(prompt)
        check_logit_bias(params, self.vocab_size)
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        request = Request(request_id, token_ids, params, priority=priority, arrival_time=self.clock() - waited_s,
                          pooling=pooling)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        adapter = None if lora is None or adapters is None else (lora, adapters.acquire(lora))
        if grammar is not None or adapter is not None:
            self._pending[request_id] = (request, grammar, adapter)
        else:
            self.scheduler.add_request(request)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                                  request.arrival_time)

    def _pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's pooling where it gives none, checked against the model."""
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise InvalidRequestError("dimensions", f"dimensions must be at most the model's hidden size "
                                                    f"{self.hidden_size}, got {params.dimensions}")
        return dataclasses.replace(params, pooling=params.pooling or self.config.model.pooling)

    def _admit_pending(self) -> list[Event]:
        """Hands the requests whose constraint compiled and adapter loaded to the scheduler;
        refuses those whose constraint or adapter failed. With nothing else to run, waits a
        little for one first."""
        if not self._pending:
            return []
        if not self.scheduler.has_unfinished():
            futures = [f for _, grammar, adapter in self._pending.values()
                       for f in (grammar, adapter and adapter[1]) if f is not None]
            wait(futures, COMPILE_WAIT_S, FIRST_COMPLETED)
        events: list[Event] = []
        for request_id, (request, grammar, adapter) in list(self._pending.items()):
            if (grammar is not None and not grammar.done()) or (adapter is not None and not adapter[1].done()):
                continue
            error = (grammar.exception() if grammar is not None else None) or (
                adapter[1].exception() if adapter is not None else None)
            if error is not None:
                if not isinstance(error, Exception):  # an interrupt, not a refusal
                    raise error
                del self._pending[request_id]
                if adapter is not None and adapter[1].exception() is not None and self.adapters is not None:
                    self.adapters.forget_load(adapter[0])
                events.append(self.output_processor.refuse(request_id, error))
                continue
            if adapter is not None and self.adapters is not None:
                request.adapter = self.adapters.install(*adapter)
                if request.adapter is None:  # every slot's adapter runs: wait for one to end
                    continue
            del self._pending[request_id]
            if grammar is not None:
                request.constraint = RequestGrammar(grammar.result())
            self.scheduler.add_request(request)
        return events

    def abort_request(self, request_id: str) -> Event | None:
        """Ends every sample of the request and frees its blocks; its final output, or None."""
        self._pending.pop(request_id, None)
        self.scheduler.finish_group(request_id, FinishReason.ABORT)
        return self.output_processor.abort(request_id) or self.beams.abort(request_id)

    def fail_all(self, error: Exception) -> list[RequestError]:
        """Ends every request with `error` (a step the engine could not attribute to one request)."""
        failed = self.output_processor.request_ids() + self.beams.request_ids()
        self._ahead = None  # its requests end here; nothing reads its work
        for request_id in failed:
            self.abort_request(request_id)
        return [RequestError(rid, RequestFailedError(f"engine step failed: {error}")) for rid in failed]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._ahead is not None

    def get_stats(self) -> EngineStats:
        stats = self.scheduler.make_stats(self._last_step)
        if self.adapters is None:
            return stats
        counters = self.adapters.counters
        return dataclasses.replace(stats, lora_adapters=tuple(self.adapters.loaded), num_lora_loads=counters.loads,
                                   num_lora_evictions=counters.evictions, lora_load_seconds=counters.load_seconds)

    # ---- one step ------------------------------------------------------------------------
    def step(self, hold_deltas: bool = False) -> list[Event]:
        """One iteration: schedule, run the ragged batch, update requests. Returns deltas, and
        errors for the requests that failed. The step launched ahead by the last call, if any,
        is this call's step. `hold_deltas`: a running request's deltas only with its first
        tokens or its end; the others are held until a step that does not hold them."""
        compiled = self._admit_pending()
        if self._ahead is None and not self.scheduler.has_unfinished():
            return compiled
        t0 = time.perf_counter()
        scheduling, num_drafting = 0.0, 0
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
        else:
            out = self.scheduler.schedule()
            num_drafting = sum(bool(item.draft_token_ids) for item in out.scheduled)  # before the runner fills them
            scheduling = time.perf_counter() - t0
            launched = self.runner.launch(out)
        out = launched.out
        if self.runs_ahead:
            t1 = time.perf_counter()
            ahead = self.scheduler.schedule_ahead(out)
            scheduling += time.perf_counter() - t1
            if ahead is not None:
                self._ahead = self.runner.launch(ahead, previous=launched)
        result = self.runner.collect(launched)
        t2 = time.perf_counter()
        update = self.scheduler.update_from_output(out, result)
        events, stopped, failed = self.output_processor.process(update, result.logprobs, hold_deltas)
        for request_id in stopped:
            self.scheduler.finish_request(request_id, FinishReason.STOP)
        for group_id in failed:
            self.scheduler.finish_group(group_id, FinishReason.ERROR)
        events += self.beams.process(update, result.logprobs)
        t3 = time.perf_counter()
        num_tokens = out.total_num_scheduled_tokens
        self.scheduler.observe_step(num_tokens, t3 - t0 - result.draft_seconds, result.draft_passes,
                                    result.draft_seconds, num_drafting, result.draft_catch_up_tokens)
        self._last_step = self._last_step.after(len(out.scheduled), num_tokens, t3 - t0, scheduling + (t3 - t2),
                                                launched_next=self._ahead is not None)
        return compiled + events


def host_memory_available() -> int:
    """Bytes of memory the host can give without swapping (/proc/meminfo's MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable: set kv_cache_memory_bytes")
