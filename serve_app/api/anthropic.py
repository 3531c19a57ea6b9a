"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request as a
chat turn (system, text, tool_use, tool_result and thinking blocks as OpenAI chat messages; tools
and tool_choice as the engine's), its output as content blocks (thinking, text, tool_use), streamed
as Anthropic's events, and errors in Anthropic's shape (`{"type": "error", "error": {...}}`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BeforeValidator, Field

from engine.chat_output import ChatOutputParser
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.api.chat_turn import ChatTurn, ToolUse, chat_job, chat_template, named, template_variable
from serve_app.api.outputs import Block, OutputBlocks, Tally
from serve_app.api.wire import APIError, Route, WireModel, refuse_media
from serve_app.jobs import Sampling
from serve_app.messages import StreamChunk

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """An error as Anthropic's API answers it."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


# ---------------------------------------------------------------- the request


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; the prefix cache works unasked.")


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(WireModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[ContentBlock], BeforeValidator(refuse_media)]


class ToolDefinition(WireModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    def as_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(WireModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, description="Accepted; the reasoning ends when the model ends it.")
    display: Literal["summarized", "omitted"] | None = Field(None, description="omitted: thinking blocks come "
                                                                               "with their text left out.")


class JsonOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="The template's reasoning_effort (xhigh and max: high), where the template takes it.")
    format: JsonOutputFormat | None = Field(None, description="A JSON schema the answer follows.")


class Metadata(WireModel):
    user_id: str | None = None


class Conversation(WireModel):
    """What a Messages request and its count_tokens share: the conversation, its tools, thinking
    and effort, as one chat turn (serve_app.api.chat_turn)."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @cached_property
    def tool_use(self) -> ToolUse:
        tools, choice = [t.as_chat() for t in self.tools or []], self.tool_choice
        if choice is None:
            return ToolUse.of(tools)
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice of type tool names the tool", param="tool_choice")
        chat_choice = named(choice.name) if choice.type == "tool" and choice.name is not None \
            else {"any": "required"}.get(choice.type, choice.type)
        return ToolUse.of(tools, chat_choice, not choice.disable_parallel_tool_use)

    def template_kwargs(self, template: str) -> dict[str, Any]:
        """`thinking` as the template's enable_thinking where it reads one (else only where it asks
        for nothing the template could not do: thinking off for a model that never thinks), and
        output_config.effort as its reasoning_effort where it reads one."""
        return _thinking(self.thinking, template) | _effort(self.output_config, template)

    def chat_turn(self, template: str) -> ChatTurn:
        return ChatTurn(self.chat_messages(), self.tool_use, self.template_kwargs(template))

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages (engine.tokenization.render_chat's)."""
        system = self.system if isinstance(self.system, str) or self.system is None \
            else "".join(b.text for b in self.system)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
                else message.content
            if message.role == "user":
                for block in blocks:
                    if isinstance(block, ToolResultBlock):
                        messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
                    elif not isinstance(block, TextBlock):
                        raise APIError(400, f"a user message cannot hold a {block.type} block", param="messages")
                text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
                if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    messages.append({"role": "user", "content": text})
                continue
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise APIError(400, "an assistant message cannot hold a tool_result block", param="messages")
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks
                                                                           if isinstance(b, TextBlock))}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                turn["tool_calls"] = calls
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thinking:
                turn["reasoning_content"] = turn["thinking"] = thinking
            messages.append(turn)
        return messages



class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    metadata: Metadata | None = None
    priority: int | None = Field(None, description="Lower is served sooner; None: the API key's default.")

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        fmt = self.output_config.format if self.output_config is not None else None
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              stop=self.stop_sequences or [],
                              structured_outputs=StructuredOutputsParams(json=fmt.schema_) if fmt else None)

    def beam_search_params(self, max_tokens: int) -> None:
        return None


class CountTokensRequest(Conversation):
    """count_tokens: a Messages request's conversation, nothing generated."""


def _thinking(thinking: ThinkingConfig | None, template: str) -> dict[str, Any]:
    """The template's enable_thinking where it reads one; a model whose template has no switch
    thinks as it always does (agent clients send `thinking` to every model, and llama.cpp takes it
    so too): its answer then holds thinking blocks where, and only where, the model thought."""
    if thinking is None or "enable_thinking" not in template:
        return {}
    return {"enable_thinking": thinking.type != "disabled"}


def _effort(config: OutputConfig | None, template: str) -> dict[str, Any]:
    if config is None or config.effort is None:
        return {}
    return template_variable("reasoning_effort", {"xhigh": "high", "max": "high"}.get(config.effort, config.effort),
                             template, "output_config.effort")


# ---------------------------------------------------------------- the output


def _sse(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n"


class MessagesFormatter:
    """A message from the engine's chunks, or its stream of Anthropic's events."""

    def __init__(self, message_id: str, model: str, req: MessagesRequest,
                 output_parser: Callable[[], ChatOutputParser]):
        self.message_id, self.model = message_id, model
        self.tally = Tally(1)
        self._parser = output_parser()
        self._blocks = OutputBlocks()
        self._tool_ids: dict[int, str] = {}
        self._started = False
        self._finish: tuple[str | None, str | None] = (None, None)  # finish reason, stop string
        self._shows_thinking = req.thinking is None or req.thinking.display != "omitted"

    def _content(self, block: Block, done: bool) -> dict[str, Any]:
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if done and self._shows_thinking else "",
                    "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        tool_id = self._tool_ids.setdefault(block.index, f"toolu_{uuid.uuid4().hex[:24]}")
        return {"type": "tool_use", "id": tool_id, "name": block.tool_call.name,
                "input": json.loads(block.text) if done and block.text.strip() else {}}

    def _stop(self) -> tuple[str, str | None]:
        reason, stop_string = self._finish
        if any(b.kind == "call" for b in self._blocks.blocks):
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        return ("stop_sequence", stop_string) if stop_string is not None else ("end_turn", None)

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], output_tokens: int
                 ) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": self.tally.usage().prompt_tokens, "output_tokens": output_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self.tally.add(chunk, offset)

    def response(self) -> dict[str, Any]:
        choice = self.tally.choice(0)
        self._finish = (choice.finish_reason, choice.stop_string)
        self._blocks.feed(self._parser.feed(choice.text) + self._parser.finish())
        self._blocks.close()
        content = [self._content(b, done=True) for b in self._blocks.blocks]
        return self._message(content, self._stop(), self.tally.usage().completion_tokens)

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        self.tally.count(chunk, offset)
        text = ""
        if not self._started:
            self._started = True
            text += _sse("message_start", {"message": self._message([], (None, None), 0)})
        for d in chunk.outputs:
            delta = self._parser.feed(d.text)
            if d.finish_reason is not None:
                delta += self._parser.finish()
                self._finish = (d.finish_reason, d.stop_string)
            text += "".join(self._events(*event) for event in self._blocks.feed(delta))
        return text

    def _events(self, change: str, block: Block, grown: str) -> str:
        if change == "open":
            return _sse("content_block_start", {"index": block.index, "content_block": self._content(block, False)})
        if change == "close":
            signature = _sse("content_block_delta", {"index": block.index, "delta": {
                "type": "signature_delta", "signature": ""}}) if block.kind == "reasoning" else ""
            return signature + _sse("content_block_stop", {"index": block.index})
        if block.kind == "reasoning" and not self._shows_thinking:
            return ""
        delta = {"reasoning": {"type": "thinking_delta", "thinking": grown},
                 "text": {"type": "text_delta", "text": grown},
                 "call": {"type": "input_json_delta", "partial_json": grown}}[block.kind]
        return _sse("content_block_delta", {"index": block.index, "delta": delta})

    def stream_end(self) -> str:
        text = "".join(self._events(*event) for event in self._blocks.close())
        stop_reason, stop_sequence = self._stop()
        text += _sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": self.tally.usage().completion_tokens}})
        return text + _sse("message_stop", {})

    def stream_error(self, error: APIError) -> str:
        return f"event: error\ndata: {json.dumps(error_body(error), separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------- the routes


class MessagesAPI:
    routes = (Route("POST", "/v1/messages", "create", (MessagesRequest,), error_body),
              Route("POST", "/v1/messages/count_tokens", "count_tokens", (CountTokensRequest,), error_body))

    def __init__(self, front: FrontEnd):
        self.front = front

    async def create(self, request: Request) -> Response:
        req, target = await self.front.accept(request, MessagesRequest)
        message_id = f"msg_{uuid.uuid4().hex}"
        turn = req.chat_turn(chat_template(target.model.info))
        job, parser = await chat_job(message_id, turn, target, Sampling(req, req.max_tokens, req.max_tokens,
                                                                        param="messages"))
        return await self.front.respond([job], MessagesFormatter(message_id, req.model, req, parser), req.stream,
                                        target)

    async def count_tokens(self, request: Request) -> dict[str, int]:
        """The prompt tokens a Messages request would take."""
        req, model = await self.front.validated(request, CountTokensRequest)
        turn = req.chat_turn(chat_template(model.info))
        _, ids = await model.chat_prompt(turn.messages, turn.tools.offered, template_kwargs=turn.template_kwargs)
        return {"input_tokens": len(ids)}
