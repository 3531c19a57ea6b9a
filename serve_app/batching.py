"""`CallBatcher`: what arrives while a call is on its way goes together in the next call.

Every hop of the request path is a Serve message that costs both processes ~0.1 ms of CPU
whatever it holds (BENCHMARKS.md), a burst's requests arrive together, and they end together. So
the ingress asks the router for admissions, releases them, submits requests to a replica, aborts
them there, and tokenizes prompts in batches: each of those is a CallBatcher with its own `send`.
The first item starts a sender task; items added while `send` runs wait for the next; the task
ends once a `send` finds nothing new. The task is the batcher's own, so a caller's cancellation
never cuts a call short.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
logger = logging.getLogger("cbserve.batching")


class CallBatcher(Generic[T]):
    def __init__(self, send: Callable[[list[T]], Awaitable[None]], max_batch: int | None = None):
        """`send(items)`: one call with the items that accumulated, in their order; it handles its
        own failures (an exception it lets out is logged, and the next batch goes on);
        `max_batch`: at most this many items a call (None: all that accumulated)."""
        self._send, self._max_batch = send, max_batch
        self._pending: list[T] = []
        self._task: asyncio.Task | None = None

    def add(self, item: T) -> None:
        self._pending.append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, item: T) -> bool:
        """Withdraws an item not yet sent; False if it was sent (or never added)."""
        try:
            self._pending.remove(item)
        except ValueError:
            return False
        return True

    @property
    def busy(self) -> bool:
        """A call is on its way or items wait for one."""
        return self._task is not None

    async def _run(self) -> None:
        try:
            while self._pending:
                cut = len(self._pending) if self._max_batch is None else self._max_batch
                batch, self._pending = self._pending[:cut], self._pending[cut:]
                try:
                    await self._send(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("a batched call of %d items failed", len(batch))
        finally:
            self._task = None


class KeyedBatchers(Generic[T]):
    """One CallBatcher per key (an engine replica), made on first use and dropped when idle."""

    def __init__(self, send: Callable[[str, list[T]], Awaitable[None]]):
        self._send = send
        self._batchers: dict[str, CallBatcher[T]] = {}

    def add(self, key: str, item: T) -> None:
        batcher = self._batchers.get(key)
        if batcher is None or not batcher.busy:
            batcher = self._batchers[key] = CallBatcher(functools.partial(self._send, key))
        batcher.add(item)

    def discard(self, key: str, item: T) -> bool:
        batcher = self._batchers.get(key)
        return batcher is not None and batcher.discard(item)
