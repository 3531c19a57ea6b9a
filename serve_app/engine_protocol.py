"""`EngineClient`: the engine surface the serve layer depends on (docs/CONTRACT.md, AsyncEngine).

Owns: the abstract interface only. `engine.AsyncEngine` satisfies it structurally; tests inject a
fake that does too. Nothing here imports `engine`, so serve_app imports without a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, AsyncIterator


class EngineClient(ABC):
    """What `EngineReplica` calls on its engine.

    - `generate` yields RequestOutput DELTAS (per changed choice index, only the new tokens/text);
      the last one has `finished=True`. Invalid input raises ValueError (message starts with the
      field name) before anything is yielded. Cancelling the consumer aborts the request.
    - `abort` frees the request's KV blocks at once; unknown ids are ignored.
    - `stats` is a cheap snapshot with at least num_waiting, num_running, num_free_blocks,
      num_total_blocks, kv_usage.
    """

    tokenizer: Any

    @classmethod
    @abstractmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> "EngineClient": ...

    @abstractmethod
    def generate(
        self, prompt: str | list[int], params: Any, request_id: str, priority: int = 0
    ) -> AsyncIterator[Any]: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def stats(self) -> Any: ...

    @abstractmethod
    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    @abstractmethod
    def shutdown(self) -> None: ...
