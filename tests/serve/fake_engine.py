"""A deterministic fake of the engine.client.EngineClient contract for serve tests.

Tokens: word-level; token id t decodes to " t{t}". Generation: greedy picks
10 + (sum(prompt) + 7 * step) % 40; with temperature > 0 a Random(seed) picks from 10..49.
Concurrency: at most `max_num_seqs` requests run; others wait (FIFO). Each step sleeps
`step_delay_s` and yields one token per live choice. Records the order requests got a slot.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.metrics import EngineStats, ModelReport
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import PoolingParams, SamplingParams

VOCAB = 64


class FakeTokenizer:
    """Words as token ids ("t7" is 7); no special tokens, so add_special_tokens changes nothing."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            if word.startswith("t") and word[1:].isdigit():
                ids.append(int(word[1:]) % VOCAB)
            else:
                ids.append(10 + zlib.crc32(word.encode()) % 40)
        return ids

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        """The generation prompt is token 3 ("t3")."""
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"bad role {m['role']}")
        text = " ".join(f"{m['role']} {m['content']}" for m in messages) + (" t3" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f" t{i}" for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"t{i}" for i in ids]


def fake_embedding(prompt_ids: list[int], dimensions: int | None = None) -> list[float]:
    """The fake's embedding: hidden_size values from the prompt's ids, the first `dimensions`
    kept, L2-normalised."""
    values = [1.0 + (sum(prompt_ids) * (k + 3) + len(prompt_ids)) % 17 for k in range(FakeAsyncEngine.hidden_size)]
    values = values[:dimensions]
    norm = sum(v * v for v in values) ** 0.5
    return [v / norm for v in values]


@dataclass
class _Live:
    request_id: str
    num_blocks: int
    aborted: bool = False


class FakeAsyncEngine(EngineClient):
    step_delay_s = 0.002
    max_num_seqs = 4
    num_blocks = 64
    block_size = 16
    max_model_len = 256
    vocab_size = VOCAB
    hidden_size = 8
    eos_token_ids = frozenset()
    is_ready = True
    tokenizer = FakeTokenizer()
    chat_format = ChatOutputFormat(None, "hermes")
    model_report = ModelReport("none", "float32", "float32", "cpu", 0, "LlamaForCausalLM", "native", 1.0, 0.0)

    def __init__(self) -> None:
        self._waiting: list[str] = []
        self._running: dict[str, _Live] = {}
        self._slot_freed = asyncio.Condition()
        self.started: list[str] = []  # request ids in the order they got a slot
        self.start_times: dict[str, float] = {}  # request id -> time.monotonic() at its slot
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.shut_down = False

    @classmethod
    def with_options(cls, **options: object) -> type[FakeAsyncEngine]:
        return type("FakeAsyncEngineVariant", (cls,), dict(options))

    @classmethod
    def from_config(cls, config: EngineConfig, engine_process: bool = False,
                    draft_transport: Any = None, output_interval_s: float = 0.0) -> FakeAsyncEngine:
        """Sizes from the class (with_options), unless the config sets them."""
        engine = cls()
        engine.num_blocks = config.cache.num_blocks or cls.num_blocks
        engine.block_size = config.cache.block_size
        engine.max_model_len = config.model.max_model_len or cls.max_model_len
        model = config.model
        mode = "none" if model.quantization == "auto" else model.quantization  # as the engine resolves it: no weights
        engine.model_report = ModelReport(mode, model.resolved_dtype, model.resolved_dtype, model.device, 0,
                                          "LlamaForCausalLM", "native", 1.0, 0.0)
        return engine

    def stats(self) -> EngineStats:
        used = sum(r.num_blocks for r in self._running.values())
        return EngineStats(
            num_waiting=len(self._waiting), num_running=len(self._running), max_num_seqs=self.max_num_seqs,
            num_swapped=0,
            num_free_blocks=self.num_blocks - used, num_total_blocks=self.num_blocks,
            kv_usage=used / self.num_blocks, prefix_cache_hit_rate=0.0, batch_size=len(self._running),
            batch_tokens=len(self._running), step_latency_s=self.step_delay_s, scheduler_overhead_s=0.0,
            num_steps=0, num_decode_only_steps=0, decode_only_rows=0, decode_only_steps_s=0.0, mixed_steps_s=0.0,
            num_steps_ahead=0, num_queued_tokens=0,
            num_preemptions_swap=0, num_preemptions_recompute=0,
            num_blocks_swapped_out=0, num_blocks_swapped_in=0, num_recomputed_tokens=0, num_prompt_tokens=0,
            num_generation_tokens=0, num_failed_requests=0)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._running

    def abort(self, request_id: str) -> None:
        live = self._running.get(request_id)
        if live is not None:
            live.aborted = True

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut_down = True

    async def generate(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                       waited_s: float = 0.0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "prompt: must not be empty")
        if any(not 0 <= t < VOCAB for t in ids):
            raise InvalidRequestError("prompt", f"prompt: token ids must be in [0, {VOCAB})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"max_tokens: prompt ({len(ids)}) + max_tokens "
                                                    f"({params.max_tokens}) > max_model_len ({self.max_model_len})")
        metrics = RequestMetrics(time.time() - waited_s)
        async for out in self._generate(ids, prompt, params, request_id, metrics):
            yield out

    def load_adapter(self, name: str, path: str) -> None:
        raise InvalidRequestError("model", f"LoRA adapter {name!r}: the fake engine serves none")

    async def embed(self, prompt_token_ids: list[int], params: PoolingParams, request_id: str, priority: int = 0,
                    waited_s: float = 0.0, lora: str | None = None) -> RequestOutput:
        """fake_embedding(prompt) after a step delay (the slot rules of generation do not apply)."""
        await asyncio.sleep(self.step_delay_s)
        return RequestOutput(request_id, None, list(prompt_token_ids), [CompletionOutput(0, "", [], "stop")], True,
                             RequestMetrics(time.time() - waited_s),
                             embedding=fake_embedding(prompt_token_ids, params.dimensions))

    async def beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams, request_id: str,
                          priority: int = 0, waited_s: float = 0.0, lora: str | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """The search over the fake's next-token rule: 10 + sum(context) % 40 at logprob -0.5,
        the token after it at -1.5; one step per step delay."""
        search = BeamSearch(prompt_token_ids, params, self.eos_token_ids, self.max_model_len)
        while not search.done:
            await asyncio.sleep(self.step_delay_s)
            nexts = [10 + (sum(prompt_token_ids) + sum(beam.token_ids)) % 40 for beam in search.running]
            search.advance([{t: -0.5, (t + 1) % VOCAB: -1.5} for t in nexts])
        yield search.output(request_id, self.tokenizer)

    async def _generate(self, ids, prompt, params, request_id, metrics):
        self._waiting.append(request_id)
        try:
            async with self._slot_freed:
                await self._slot_freed.wait_for(
                    lambda: len(self._running) < self.max_num_seqs
                    and self._waiting[0] == request_id
                )
                self._waiting.pop(0)
                self._slot_freed.notify_all()
        except BaseException:
            if request_id in self._waiting:
                self._waiting.remove(request_id)
            raise
        blocks = -(-(len(ids) + params.max_tokens) // self.block_size)
        live = self._running[request_id] = _Live(request_id, blocks)
        self.started.append(request_id)
        self.start_times[request_id] = time.monotonic()
        completed = False
        try:
            async for out in self._decode(ids, prompt, params, live, metrics):
                yield out
            completed = not live.aborted
        finally:
            self._running.pop(request_id, None)
            (self.finished if completed else self.aborted).append(request_id)
            async with self._slot_freed:
                self._slot_freed.notify_all()

    async def _decode(self, ids, prompt, params, live, metrics):
        rngs = [random.Random(None if params.seed is None else params.seed * 1000 + i)
                for i in range(params.n)]
        texts = [""] * params.n
        done = [False] * params.n
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        for step in range(params.max_tokens):
            await asyncio.sleep(self.step_delay_s)
            outputs = []
            for i in range(params.n):
                if done[i]:
                    continue
                if live.aborted:
                    done[i] = True
                    outputs.append(CompletionOutput(i, "", [], "abort"))
                    continue
                if params.greedy:
                    tok = 10 + (sum(ids) + 7 * step) % 40
                else:
                    tok = rngs[i].randrange(10, 50)
                piece = f" t{tok}"
                finish = None
                new_text = texts[i] + piece
                hit = next((s for s in stops if s in new_text), None)
                if hit is not None:
                    piece = new_text[: new_text.index(hit)][len(texts[i]):]
                    finish = "stop"
                elif params.stop_token_ids and tok in params.stop_token_ids:
                    piece, finish = "", "stop"
                elif step == params.max_tokens - 1:
                    finish = "length"
                texts[i] += piece
                lp = None
                if params.logprobs is not None:
                    lp = [{tok: -0.5, (tok + 1) % VOCAB: -1.5}]
                outputs.append(CompletionOutput(i, piece, [tok], finish, lp))
                done[i] = finish is not None
            now = time.time()
            metrics.first_token_time = metrics.first_token_time or now
            metrics.finished_time = now if all(done) else None
            yield RequestOutput(live.request_id, prompt if isinstance(prompt, str) else None,
                                ids, outputs, all(done), metrics)
            if all(done):
                return
