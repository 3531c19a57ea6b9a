"""What every API's output shares: the formatter protocol the job runner drives, the tally of a
response's choices and usage, and an output's parts as blocks.

A formatter is composed of these (and of its API's framing), not derived from another API's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.chat_output import ChatDelta
from engine.outputs import CompletionOutput, merge_deltas
from engine.tools import ToolCall
from serve_app.api.wire import APIError, Usage
from serve_app.messages import StreamChunk


class Formatter(Protocol):
    """A whole response from its jobs' chunks (serve_app.jobs drives it)."""

    def add(self, chunk: StreamChunk, offset: int) -> None:
        """A chunk of the job whose choices start at `offset`."""

    def response(self) -> dict[str, Any]:
        """The JSON body, once every job ended."""


class StreamFormatter(Formatter, Protocol):
    """A response that may also be streamed: its API's events."""

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        """The events of a chunk of the job whose choices start at `offset`."""

    def stream_end(self) -> str:
        """What ends a stream whose jobs all ended."""

    def stream_error(self, error: APIError) -> str:
        """What ends a stream a job failed."""


class Tally:
    """A response's choices (each the merge of its deltas, engine.outputs.merge_deltas) and its
    token usage, over the response's jobs."""

    def __init__(self, num_choices: int):
        self.num_choices = num_choices
        self.choices: dict[int, CompletionOutput] = {}  # response choice index -> cumulative output
        self._num_prompt: dict[int, int] = {}  # per job (its choice offset): prompt tokens
        self._num_completion = 0

    def count(self, chunk: StreamChunk, offset: int) -> None:
        """Counts a chunk's tokens (a stream keeps no text)."""
        self._num_prompt[offset] = chunk.num_prompt_tokens or self._num_prompt.get(offset, 0)
        self._num_completion += sum(len(o.token_ids) for o in chunk.outputs)

    def add(self, chunk: StreamChunk, offset: int) -> None:
        """Counts a chunk's tokens and merges its deltas into its choices."""
        self.count(chunk, offset)
        merge_deltas(self.choices, chunk.outputs, offset)

    def choice(self, index: int) -> CompletionOutput:
        return self.choices.get(index) or CompletionOutput(index, "", [])

    def all_choices(self) -> list[CompletionOutput]:
        return [self.choice(i) for i in range(self.num_choices)]

    def usage(self) -> Usage:
        return Usage.of(sum(self._num_prompt.values()), self._num_completion)


@dataclass(slots=True)
class Block:
    """One part of a choice's output: its reasoning, its text, or one tool call."""
    kind: str  # "reasoning", "text" or "call"
    index: int  # its place among the output's blocks
    text: str = ""  # the reasoning or text so far; a call's arguments
    call: ToolCall | None = None

    @property
    def tool_call(self) -> ToolCall:
        """A call block's call."""
        if self.call is None:
            raise ValueError(f"a {self.kind} block holds no tool call")
        return self.call


class OutputBlocks:
    """One output's parts as blocks, opened, grown and closed as its parsed deltas arrive: the
    Responses API's output items and the Messages API's content blocks. Reasoning and text each
    grow the open block of their kind, or close it and open one; a call is a block of its own."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, delta: ChatDelta) -> list[tuple[str, Block, str]]:
        """("open" | "delta" | "close", block, the text it grew by), for each change in order."""
        events: list[tuple[str, Block, str]] = []
        for kind, text in (("reasoning", delta.reasoning), ("text", delta.content)):
            if not text:
                continue
            if self._open is None or self._open.kind != kind:
                events += self.close()
                self._open = Block(kind, len(self.blocks))
                self.blocks.append(self._open)
                events.append(("open", self._open, ""))
            self._open.text += text
            events.append(("delta", self._open, text))
        for call in delta.calls:
            events += self.close()
            block = Block("call", len(self.blocks), call.arguments, call)
            self.blocks.append(block)
            events += [("open", block, ""), ("delta", block, call.arguments), ("close", block, "")]
        return events

    def close(self) -> list[tuple[str, Block, str]]:
        """Closes the open block, if any."""
        block, self._open = self._open, None
        return [("close", block, "")] if block is not None else []
