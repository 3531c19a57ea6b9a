"""The synchronous engine: add requests, step, get outputs. Tokenizer at the edges.

`step()` is schedule -> execute -> update -> outputs; everything else belongs to one owner.
Not thread-safe: AsyncEngine drives it from one thread.
"""
from __future__ import annotations

import time

import torch

from engine.attention.base import select_backend
from engine.config import EngineConfig
from engine.kv_cache.manager import KVCacheManager
from engine.metrics import EngineStats, StatsCollector
from engine.model_loader import eos_token_ids, load_hf
from engine.models.registry import build_model
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import FinishReason, Request
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.scheduler import PreemptionCosts, Scheduler


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template applied, generation prompt added."""
    if not messages:
        raise ValueError("messages must not be empty")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.model.num_threads is not None:  # process-wide: the engine is the process's main work
            torch.set_num_threads(config.model.num_threads)
        device = torch.device(config.model.device)
        hf_model, self.tokenizer = load_hf(config.model.model)
        self.max_model_len = config.model.max_model_len or hf_model.config.max_position_embeddings
        model = build_model(hf_model, self.max_model_len).to(device)
        eos = eos_token_ids(hf_model, self.tokenizer)
        del hf_model
        self.vocab_size = model.vocab_size
        cache = config.cache
        block_bytes = ModelRunner.block_bytes(model, cache.block_size)
        # never more blocks than max_num_seqs requests of max_model_len tokens can fill
        useful_blocks = -(-config.scheduler.max_num_seqs * self.max_model_len // cache.block_size)
        num_blocks = cache.num_blocks or min(cache.kv_cache_memory_bytes // block_bytes, useful_blocks)
        num_host_blocks = cache.swap_space_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes {cache.kv_cache_memory_bytes} holds no {block_bytes}-byte block")
        self.kv = KVCacheManager(num_blocks, cache.block_size, num_host_blocks, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, eos, PreemptionCosts(block_bytes))
        backend = select_backend(config.model.attention_backend, device, model.head_dim ** -0.5)
        self.runner = ModelRunner(model, backend, num_blocks, num_host_blocks, cache.block_size, device,
                                  config.model.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = StatsCollector(self.scheduler)

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args))

    # ---- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenizes and validates a prompt; raises ValueError naming the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             f"and at least one token must follow the prompt")
        return token_ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queues a request (validated first: ValueError leaves the engine unchanged)."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.encode_prompt(prompt)
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        request = Request(request_id, token_ids, params, priority=priority)
        self.scheduler.add_request(request)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                                  request.arrival_time)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends every sample of the request and frees its blocks; its final output, or None."""
        for rid in [r.request_id for r in self.scheduler.requests.values() if r.group_id == request_id]:
            self.scheduler.finish_request(rid, FinishReason.ABORT)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_stats(self) -> EngineStats:
        return self.stats.snapshot()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the ragged batch, update requests. Returns deltas."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(out)
        t2 = time.perf_counter()
        updated = self.scheduler.update_from_output(out, result.sampled)
        outputs, stopped = self.output_processor.process(updated, result.logprobs)
        for request_id in stopped:
            self.scheduler.finish_request(request_id, FinishReason.STOP)
        t3 = time.perf_counter()
        self.stats.record_step(out, t3 - t0, (t1 - t0) + (t3 - t2))
        return outputs
