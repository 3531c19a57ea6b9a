"""StreamChunks -> OpenAI response bodies and SSE events (completions and chat).

Owns: choices and usage across a request's engine streams (accumulated with the engine's
merge_deltas), logprobs shaping. Does not own: transport (jobs.py frames the events as SSE).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.chat_output import ChatDelta, ChatOutputParser
from engine.outputs import CompletionOutput, merge_deltas
from engine.tools import ToolCall
from serve_app.messages import StreamChunk
from serve_app.protocol import (
    SSE_DONE,
    APIError,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
    sse_event,
)


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


class Formatter:
    object_name = ""
    chunk_object = ""

    def __init__(self, response_id: str, model: str, req: Any, tokenizer: Any, num_choices: int):
        self.response_id, self.model, self.req, self.tokenizer = response_id, model, req, tokenizer
        self.num_choices = num_choices
        self.created = int(time.time())
        self.choices: dict[int, CompletionOutput] = {}  # response choice index -> cumulative output
        self.num_prompt: dict[int, int] = {}  # per job (choice_offset) prompt tokens
        self.num_completion = 0

    # ------------------------------------------------------------ accumulation

    def _account(self, chunk: StreamChunk, offset: int) -> None:
        self.num_prompt[offset] = chunk.num_prompt_tokens or self.num_prompt.get(offset, 0)
        self.num_completion += sum(len(o.token_ids) for o in chunk.outputs)

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self._account(chunk, offset)
        merge_deltas(self.choices, chunk.outputs, offset)

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _choice(self, index: int) -> CompletionOutput:
        return self.choices.get(index) or CompletionOutput(index, "", [])

    def usage(self) -> Usage:
        return Usage.of(sum(self.num_prompt.values()), self.num_completion)

    def _choice_indices(self) -> list[int]:
        return list(range(self.num_choices))

    # ------------------------------------------------------------ streaming

    def stream_events(self, chunk: StreamChunk, offset: int) -> list[dict[str, Any]]:
        self._account(chunk, offset)
        events = []
        for d in chunk.outputs:
            choice = self._stream_choice(offset + d.index, d)
            event = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
                     "model": self.model, "choices": [choice]}
            if self.req.include_usage:
                event["usage"] = self.usage().model_dump() if self.req.continuous_usage else None
            events.append(event)
        return events

    def usage_event(self) -> dict[str, Any] | None:
        if not self.req.include_usage:
            return None
        return {"id": self.response_id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage().model_dump()}

    # the stream's framing: each API's own (OpenAI's chat and completions: data lines, then [DONE])

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        """The SSE text of a chunk of the job whose choices start at `offset`."""
        return "".join(sse_event(event) for event in self.stream_events(chunk, offset))

    def stream_end(self) -> str:
        """What ends a stream whose jobs all ended."""
        usage_event = self.usage_event()
        return (sse_event(usage_event) if usage_event is not None else "") + SSE_DONE

    def stream_error(self, error: APIError) -> str:
        """What ends a stream a job failed."""
        return sse_event(error.body()) + SSE_DONE

    def _stream_choice(self, index: int, d: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def _top(self, entries: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entries.items(), key=lambda kv: -kv[1])


class CompletionFormatter(Formatter):
    """With `echo`, each choice's text starts with its prompt's (streamed: in its first chunk), and
    with `logprobs` too, its logprobs start with the prompt tokens' (the first one's null)."""
    chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._echoed: set[int] = set()
        self._prompt_logprobs: dict[int, list[tuple[int, dict[int, float] | None]]] = {}  # by prompt index

    def _account(self, chunk: StreamChunk, offset: int) -> None:
        super()._account(chunk, offset)
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs[offset // self.req.n] = chunk.prompt_logprobs

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts()[index // self.req.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _logprobs(self, pairs: list[tuple[int, dict[int, float] | None]]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets, pos = [], [], [], [], 0
        k = self.req.logprobs or 0
        for token_id, entries in pairs:
            s = self._token_str(token_id)
            tokens.append(s)
            token_logprobs.append(entries.get(token_id) if entries is not None else None)
            top.append({self._token_str(t): lp for t, lp in self._top(entries)[:k]} if entries is not None else None)
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def _choice_logprobs(self, index: int, c: CompletionOutput, first: bool) -> dict[str, Any] | None:
        """The choice's (new) tokens' logprobs, after its prompt's in its first part when echoed."""
        if c.logprobs is None:
            return None
        echoed = self._prompt_logprobs.get(index // self.req.n, []) if first and self.req.echo else []
        return self._logprobs(echoed + list(zip(c.token_ids, c.logprobs)))

    def _stream_choice(self, index: int, d: CompletionOutput) -> dict[str, Any]:
        first = index not in self._echoed
        self._echoed.add(index)
        text = (self._echo(index) if first else "") + d.text
        return {"index": index, "text": text, "logprobs": self._choice_logprobs(index, d, first),
                "finish_reason": d.finish_reason}

    def response(self) -> dict[str, Any]:
        choices = [
            CompletionChoice(index=c.index, text=self._echo(c.index) + c.text, finish_reason=c.finish_reason,
                             logprobs=self._choice_logprobs(c.index, c, True))
            for c in map(self._choice, self._choice_indices())
        ]
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=self.usage()).model_dump()


class ChatFormatter(Formatter):
    """Each choice's text split by the model's chat format (engine.chat_output) into reasoning
    (`reasoning_content`, and vLLM's newer `reasoning`), content and, with tools offered
    (tool_choice other than `none`), `message.tool_calls`, streamed as each call completes, with
    finish_reason `tool_calls` (OpenAI's `stop` when the call was forced by name)."""
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, output_parser: Callable[[], ChatOutputParser], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._role_sent: set[int] = set()
        self._new_parser = output_parser
        self._parsers: dict[int, ChatOutputParser] = {}

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        s = self._token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, pairs: list[tuple[int, dict[int, float]]]) -> dict[str, Any]:
        k = self.req.top_logprobs or 0
        content = []
        for token_id, entries in pairs:
            e = self._entry(token_id, entries.get(token_id))
            e["top_logprobs"] = [self._entry(t, lp) for t, lp in self._top(entries)[:k]]
            content.append(e)
        return {"content": content}

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if reason == "stop" and called and self.req.chosen_tool in ("auto", "required") else reason

    def _stream_choice(self, index: int, d: CompletionOutput) -> dict[str, Any]:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._new_parser()
        parts = parser.feed(d.text)
        if d.finish_reason is not None:
            parts += parser.finish()
        delta: dict[str, Any] = {"content": parts.content or (None if parts.calls or parts.reasoning else "")}
        if parts.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parts.reasoning
        if parts.calls:
            first = parser.num_calls - len(parts.calls)
            delta["tool_calls"] = [{"index": first + i} | call.as_openai() for i, call in enumerate(parts.calls)]
        if index not in self._role_sent:
            self._role_sent.add(index)
            delta["role"] = "assistant"
        lp = None
        if d.logprobs is not None:
            lp = self._logprobs(list(zip(d.token_ids, d.logprobs)))
        return {"index": index, "delta": delta, "logprobs": lp,
                "finish_reason": self._finish_reason(d.finish_reason, parser.num_calls > 0)}

    def _choice_out(self, c: CompletionOutput) -> ChatChoice:
        parser = self._new_parser()
        parts = parser.feed(c.text) + parser.finish()
        content, calls, reasoning = parts.content, parts.calls, parts.reasoning or None
        message = ChatMessageOut(content=(content.strip() or None) if calls else content, reasoning_content=reasoning,
                                 reasoning=reasoning, tool_calls=[call.as_openai() for call in calls])
        return ChatChoice(index=c.index, message=message,
                          finish_reason=self._finish_reason(c.finish_reason, bool(calls)),
                          logprobs=self._logprobs(list(zip(c.token_ids, c.logprobs))) if c.logprobs else None)

    def response(self) -> dict[str, Any]:
        choices = [self._choice_out(c) for c in map(self._choice, self._choice_indices())]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage()).model_dump()
