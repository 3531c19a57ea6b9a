"""`EngineReplica`: a plain class around one AsyncEngine (app.py makes it a deployment).

Owns: building the engine (`engine_cls` injectable), turning an `EngineRequest` into engine
calls, coalescing the engine's per-step deltas into at most one `StreamChunk` per
`stream_flush_interval_s` per stream (the first token and the last chunk go out at once), and
pushing its load snapshot to the router (periodically, and soon after each request ends).
Does not own: HTTP, admission, tokenization rules (the engine's tokenizer is the truth).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import pickle
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from serve_app.config import EngineReplicaConfig
from serve_app.messages import (
    ChoiceDelta,
    EngineRequest,
    ErrorInfo,
    ModelInfo,
    ReplicaStats,
    StreamChunk,
)
from serve_app.metrics import ReplicaMetrics

logger = logging.getLogger("cbserve.replica")
_MIN_REPORT_GAP_S = 0.01


def _serve_replica_id() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


async def _drain(iterator: Any) -> None:
    try:
        while True:
            await iterator.__anext__()
    except StopAsyncIteration:
        pass


def _fields(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return dict(getattr(obj, "__dict__", {}))


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:
        return False


def _error_param(message: str) -> str | None:
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.isidentifier() else None


@dataclass(slots=True)
class _DeltaBuffer:
    """Per-choice deltas accumulated since the last flush."""

    by_index: dict[int, ChoiceDelta] = field(default_factory=dict)

    def add(self, output: Any) -> None:
        d = self.by_index.get(output.index)
        if d is None:
            d = self.by_index[output.index] = ChoiceDelta(output.index, "", [], None, None)
        d.text += output.text
        d.token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            d.logprobs = (d.logprobs or []) + list(output.logprobs)
        if output.finish_reason is not None:
            d.finish_reason = output.finish_reason

    def take(self) -> list[ChoiceDelta]:
        deltas = [self.by_index[i] for i in sorted(self.by_index)]
        self.by_index = {}
        return deltas


class EngineReplica:
    """One engine; streams coalesced deltas; reports load to the router.

    `router` is anything with `report.remote(ReplicaStats)` (a DeploymentHandle, or
    serve_app.local.LocalHandle); None disables reporting.
    """

    def __init__(
        self,
        config: EngineReplicaConfig,
        router: Any = None,
        engine_cls: type | None = None,
        params_cls: type | None = None,
        replica_id: str | None = None,
        metrics_enabled: bool = False,
    ):
        if engine_cls is None or params_cls is None:
            import engine as engine_pkg

            engine_cls = engine_cls or engine_pkg.AsyncEngine
            params_cls = params_cls or engine_pkg.SamplingParams
        self.config = config
        self.engine = engine_cls.from_engine_args(
            model=config.model, engine_process=config.engine_process,
            **config.engine_args.as_kwargs()
        )
        self._params_cls = params_cls
        self.replica_id = replica_id or _serve_replica_id() or uuid.uuid4().hex[:12]
        self.metrics = ReplicaMetrics(metrics_enabled, self.replica_id)
        self._router = router
        self._num_received = 0
        self._received_ids: list[str] = []  # since the last load report
        self.num_misrouted = 0
        self._report_now: asyncio.Event | None = None
        self._report_task: asyncio.Task | None = None
        self._maybe_start_reporting()

    # ------------------------------------------------------------ deployment methods

    def model_info(self) -> ModelInfo:
        tokenizer = self.engine.tokenizer
        return ModelInfo(
            served_model_name=self.config.model_name,
            max_model_len=self.engine.max_model_len,
            block_size=self.engine.block_size,
            tokenizer_path=getattr(tokenizer, "name_or_path", None),
            tokenizer=tokenizer if _picklable(tokenizer) else None,
        )

    def stats(self) -> ReplicaStats:
        s = self.engine.stats()
        return ReplicaStats(
            replica_id=self.replica_id,
            num_waiting=int(s.num_waiting),
            num_running=int(s.num_running),
            num_free_blocks=int(s.num_free_blocks),
            num_total_blocks=int(s.num_total_blocks),
            kv_usage=float(s.kv_usage),
            num_queued_tokens=int(getattr(s, "num_queued_tokens", 0)),
            block_size=self.engine.block_size,
            received_ids=tuple(self._received_ids),
            reported_at=time.monotonic(),
        )

    async def generate(
        self, request: EngineRequest, replica_hint: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Streams the request's coalesced deltas; errors come as a final chunk with `error`.

        `replica_hint` is read by the pinning request router in the caller; unused here.
        """
        self._maybe_start_reporting()
        self._num_received += 1
        self._received_ids.append(request.request_id)
        if replica_hint is not None and replica_hint != self.replica_id:
            self.num_misrouted += 1  # the pinning router missed (e.g. a stale handle view)
        start = time.monotonic()
        first_token_at: float | None = None
        num_prompt = num_output = 0
        try:
            try:
                params = self._params_cls(**request.sampling)
                prompt = request.prompt
                if request.messages is not None:
                    prompt = self.engine.encode_chat(request.messages)
                stream = self.engine.generate(prompt, params, request.request_id, request.priority)
                if inspect.isawaitable(stream):  # `async def` returning an iterator
                    stream = await stream
            except (ValueError, TypeError) as e:
                yield StreamChunk(error=ErrorInfo(400, str(e), param=_error_param(str(e))),
                                  finished=True)
                return
            async for chunk in self._coalesce(stream, request.request_id):
                num_prompt = chunk.num_prompt_tokens or num_prompt
                if chunk.deltas and first_token_at is None:
                    first_token_at = time.monotonic()
                num_output += sum(len(d.token_ids) for d in chunk.deltas)
                yield chunk
        finally:
            self.metrics.record_request(
                request.priority,
                None if first_token_at is None else first_token_at - start,
                time.monotonic() - start,
                num_prompt,
                num_output,
            )
            if self._report_now is not None:
                self._report_now.set()

    def routing_counters(self) -> dict[str, int]:
        return {"received": self._num_received, "misrouted": self.num_misrouted}

    async def check_health(self) -> None:
        self._maybe_start_reporting()

    def shutdown(self) -> None:
        if self._report_task is not None:
            self._report_task.cancel()
        self.engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------ streaming

    async def _coalesce(self, stream: Any, request_id: str) -> AsyncIterator[StreamChunk]:
        """Merges engine deltas; flushes on the first token, every interval, and at the end.

        A pending `__anext__` is raced against the flush deadline so buffered tokens never wait
        for a slow next step longer than the interval.
        """
        interval = self.config.stream_flush_interval_s
        iterator = stream.__aiter__()
        buffer = _DeltaBuffer()
        num_prompt = 0
        last_flush = 0.0  # 0 => the first tokens flush at once
        pending: asyncio.Future | None = None
        finished = False
        try:
            while not finished:
                if pending is None:
                    pending = asyncio.ensure_future(iterator.__anext__())
                timeout = None
                if buffer.by_index:
                    timeout = max(0.0, last_flush + interval - time.monotonic())
                done, _ = await asyncio.wait({pending}, timeout=timeout)
                if done:
                    fut, pending = pending, None
                    try:
                        output = fut.result()
                    except StopAsyncIteration:
                        break
                    except ValueError as e:
                        yield StreamChunk(
                            error=ErrorInfo(400, str(e), param=_error_param(str(e))),
                            finished=True,
                        )
                        return
                    num_prompt = len(output.prompt_token_ids or []) or num_prompt
                    for out in output.outputs:
                        buffer.add(out)
                    finished = bool(output.finished)
                    if finished:  # let the engine's generator end normally (not an abort)
                        await _drain(iterator)
                    elif time.monotonic() - last_flush < interval:
                        continue
                if buffer.by_index or finished:
                    last_flush = time.monotonic()
                    self.metrics.stream_messages.inc(tags=self.metrics._tags)
                    yield StreamChunk(buffer.take(), num_prompt, finished)
            if not finished:  # iterator ended without a finished output
                yield StreamChunk(buffer.take(), num_prompt, True)
        except Exception as e:  # engine failure mid-stream: tell the client, never truncate
            logger.exception("request %s failed", request_id)
            yield StreamChunk(
                error=ErrorInfo(500, f"engine error: {e}", "internal_error"), finished=True
            )
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            else:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            if not finished:
                self.engine.abort(request_id)

    # ------------------------------------------------------------ load reports

    def _maybe_start_reporting(self) -> None:
        if self._router is None or (self._report_task and not self._report_task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._report_now = asyncio.Event()
        self._report_task = loop.create_task(self._report_loop())

    async def _report_loop(self) -> None:
        assert self._report_now is not None
        while True:
            try:
                stats = self.stats()
                del self._received_ids[: len(stats.received_ids)]
                self.metrics.record_load(stats.num_waiting, stats.num_running, stats.kv_usage)
                self.metrics.record_engine_stats(_fields(self.engine.stats()))
                await self._router.report.remote(stats)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("load report to router failed", exc_info=True)
            await asyncio.sleep(_MIN_REPORT_GAP_S)
            try:
                await asyncio.wait_for(
                    self._report_now.wait(), timeout=self.config.stats_report_interval_s
                )
            except asyncio.TimeoutError:
                pass
            self._report_now.clear()
