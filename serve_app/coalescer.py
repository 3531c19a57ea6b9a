"""`StreamCoalescer`: turns one request's engine deltas into at most one StreamChunk per
interval. Streaming capacity is bounded by messages, not tokens (docs/DESIGN.md), so a replica sends
the first token at once, then what accumulated every `interval_s`, and the last chunk at once.

Owns: buffering (engine.outputs.merge_deltas), the flush deadline, and closing the engine
stream when the consumer leaves. Does not own: error mapping (engine exceptions propagate to
the caller) or transport.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, merge_deltas
from serve_app.messages import StreamChunk


class StreamCoalescer:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.num_messages = 0
        self.num_output_tokens = 0
        self.metrics: RequestMetrics | None = None  # the engine's timings, from the latest output
        self.finished = False  # the engine's final output arrived
        self._prompt_logprobs: list[tuple[int, dict[int, float] | None]] | None = None  # until sent
        self._embedding: list[float] | None = None  # an embedding request's, until sent

    async def coalesce(self, stream: AsyncIterator[RequestOutput]) -> AsyncGenerator[StreamChunk, None]:
        """Yields merged deltas: on the first token, then when `interval_s` has passed since the
        last chunk, and with the final output. While tokens are held, the next read is raced
        against the flush deadline, so they never wait on a slow step longer than the interval;
        with none held it is awaited directly (no task and no wait: most reads, the engine's
        own outputs coming once an interval). Leaving early closes `stream` (which aborts the
        request in the engine)."""
        iterator = stream.__aiter__()
        pending: asyncio.Future | None = None  # a read raced against a deadline that came first
        buffer: dict[int, CompletionOutput] = {}
        num_prompt, last_flush, finished = 0, -math.inf, False
        try:
            while not finished:
                if buffer:
                    if pending is None:
                        pending = asyncio.ensure_future(iterator.__anext__())
                    timeout = max(0.0, last_flush + self.interval_s - self.clock())
                    done, _ = await asyncio.wait({pending}, timeout=timeout)
                    if not done:  # the deadline: flush what is held
                        last_flush = self.clock()
                        yield self._chunk(buffer, num_prompt, False)
                        buffer = {}
                        continue
                try:
                    output = await (iterator.__anext__() if pending is None else pending)
                except StopAsyncIteration:
                    break
                pending = None
                self.metrics, num_prompt = output.metrics, len(output.prompt_token_ids)
                if output.prompt_logprobs is not None:
                    self._prompt_logprobs = list(zip(output.prompt_token_ids, output.prompt_logprobs))
                self._embedding = output.embedding or self._embedding
                merge_deltas(buffer, output.outputs)
                finished = self.finished = output.finished
                if finished or self.clock() - last_flush >= self.interval_s:
                    last_flush = self.clock()
                    yield self._chunk(buffer, num_prompt, finished)
                    buffer = {}
            if finished:  # let the engine's stream end on its own (it then aborts nothing)
                async for _ in iterator:
                    pass
            else:  # the stream ended without a finished output
                yield self._chunk(buffer, num_prompt, True)
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def _chunk(self, buffer: dict[int, CompletionOutput], num_prompt: int, finished: bool) -> StreamChunk:
        self.num_messages += 1
        outputs = [buffer[i] for i in sorted(buffer)]
        self.num_output_tokens += sum(len(o.token_ids) for o in outputs)
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        embedding, self._embedding = self._embedding, None
        return StreamChunk(outputs, num_prompt, finished, prompt_logprobs=prompt_logprobs, embedding=embedding)
