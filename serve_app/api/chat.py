"""OpenAI's chat completions API (`POST /v1/chat/completions`): the conversation as one chat turn
(serve_app.api.chat_turn) of n samples, its output split by the model's chat format into
reasoning, content and tool calls, answered as a chat completion or its stream of chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.chat_output import ChatOutputParser
from engine.outputs import CompletionOutput
from serve_app.api.chat_turn import ChatTurn, ToolUse, chat_job, chat_template, template_variable
from serve_app.api.openai_common import Choice, ChunkStream, PromptLogprobs, SamplingFields, Tokens
from serve_app.api.outputs import Tally
from serve_app.api.wire import APIError, Route, Usage, WireModel, refuse_media
from serve_app.jobs import Sampling
from serve_app.messages import StreamChunk

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd

# ---------------------------------------------------------------- the request


class ContentPart(WireModel):
    type: Literal["text"]
    text: str


class FunctionCall(WireModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallIn(WireModel):
    """A call the assistant made earlier in the conversation (a streamed one's `index` too)."""
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(WireModel):
    """A message of the conversation. Keys beyond these, what clients send back of an answer
    (`refusal`, `annotations`, ids, vLLM's `reasoning`), reach the template as they are, which
    renders those it reads; any role reaches it too, which renders it or refuses it (a 400)."""
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1, description="system, developer (as system), user, assistant, tool, or a role "
                                                "the chat template renders.")
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(refuse_media)] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="An assistant turn's reasoning, as responses return it "
                                                            "(templates that keep earlier reasoning render it).")

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name} is only for assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message takes one")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message in OpenAI's format, as engine.tokenization.encode_chat takes it."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = self.model_extra or {}
        message: dict[str, Any] = {**extra, "role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        reasoning = self.reasoning_content if self.reasoning_content is not None else extra.get("reasoning")
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if isinstance(reasoning, str):  # as Qwen3's template reads it, and gpt-oss's
            message["reasoning_content"] = message["thinking"] = reasoning
        return message


class FunctionDefinition(WireModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class ToolDefinition(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class ChatFields(WireModel):
    """The conversation and its tools (chat completions and chat-form /tokenize)."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None

    def tool_definitions(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


class ChatCompletionRequest(SamplingFields, ChatFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Reaches the chat template as reasoning_effort, where the template takes it.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables the chat template reads, such "
                                                                          "as enable_thinking (vLLM's).")
    echo: bool = Field(False, description="The answer starts with the last message's content where that message is "
                                          "the answer's role's (vLLM's).")
    add_generation_prompt: bool = Field(True, description="The template's prompt for a new assistant message "
                                                          "(vLLM's).")
    continue_final_message: bool = Field(False, description="The last message left open, the output going on with "
                                                            "it (vLLM's).")

    @model_validator(mode="after")
    def _where_the_output_starts(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the output "
                             "either continues the last message or starts a new one")
        return self

    @cached_property
    def tool_use(self) -> ToolUse:
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return ToolUse.of(self.tool_definitions(), choice, self.parallel_tool_calls)

    def template_kwargs(self, template: str) -> dict[str, Any]:
        effort = {} if self.reasoning_effort is None else template_variable(
            "reasoning_effort", self.reasoning_effort, template, "reasoning_effort")
        return (self.chat_template_kwargs or {}) | effort

    def chat_turn(self, template: str) -> ChatTurn:
        return ChatTurn(self.template_messages(), self.tool_use, self.template_kwargs(template),
                        self.add_generation_prompt, self.continue_final_message)

    @property
    def echoed(self) -> str:
        """What the answer starts with under `echo`: the last message's content where it is the
        answer's role's (the assistant's, or with no generation prompt the last message's own)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.as_template_dict()["content"]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else super().requested_max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- the output


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name of reasoning_content: both are sent
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(Choice):
    message: ChatMessageOut


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatFormatter:
    """Each choice's text split by the model's chat format (engine.chat_output) into reasoning
    (`reasoning_content`, and vLLM's newer `reasoning`), content and, with tools offered
    (tool_choice other than `none`), `message.tool_calls`, streamed as each call completes, with
    finish_reason `tool_calls` (OpenAI's `stop` when the call was forced by name). A stream's
    choice opens with its role alone."""

    def __init__(self, response_id: str, model: str, req: ChatCompletionRequest, tokenizer: Any,
                 output_parser: Callable[[], ChatOutputParser], prompt_ids: list[int]):
        self.req, self.prompt_ids = req, prompt_ids
        self.tokens = Tokens(tokenizer, req.return_tokens_as_token_ids)
        self.tally = Tally(req.n)
        self._prompt_logprobs: PromptLogprobs = []
        self.stream = ChunkStream(response_id, "chat.completion.chunk", model, req.stream_options, self.tally)
        self._new_parser = output_parser
        self._parsers: dict[int, ChatOutputParser] = {}
        self._role_sent: set[int] = set()

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self.tally.add(chunk, offset)
        self._prompt_logprobs = chunk.prompt_logprobs or self._prompt_logprobs

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        self.tally.count(chunk, offset)
        self._prompt_logprobs = chunk.prompt_logprobs or self._prompt_logprobs
        return "".join(self._role(offset + d.index) + self.stream.chunk(self._stream_choice(offset + d.index, d))
                       for d in chunk.outputs)

    def _role(self, index: int) -> str:
        """A choice's first chunk: its role alone, as OpenAI, vLLM and llama.cpp send it (with
        vLLM's prompt fields, where asked, on the stream's first)."""
        if index in self._role_sent:
            return ""
        first = not self._role_sent
        self._role_sent.add(index)
        return self.stream.chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}, self._prompt_fields() if first else None)

    def _prompt_fields(self) -> dict[str, Any]:
        """vLLM's prompt_logprobs and prompt_token_ids, where the request asked for them."""
        fields: dict[str, Any] = {}
        if self.req.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.tokens.prompt_logprobs(self._prompt_logprobs, self.req.prompt_logprobs)
        if self.req.return_token_ids:
            fields["prompt_token_ids"] = self.prompt_ids
        return fields

    def stream_end(self) -> str:
        return self.stream.end()

    def stream_error(self, error: APIError) -> str:
        return self.stream.error(error)

    def _logprobs(self, pairs: list[tuple[int, dict[int, float]]]) -> dict[str, Any]:
        return {"content": self.tokens.entries(pairs, self.req.top_logprobs or 0)}

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if reason == "stop" and called and self.req.tool_use.model_chooses else reason

    def _stream_choice(self, index: int, d: CompletionOutput) -> dict[str, Any]:
        parser = self._parsers.get(index)
        opening = parser is None
        if parser is None:
            parser = self._parsers[index] = self._new_parser()
        parts = parser.feed(d.text)
        if d.finish_reason is not None:
            parts += parser.finish()
        if opening:
            parts.content = self.req.echoed + parts.content
        delta: dict[str, Any] = {"content": parts.content or (None if parts.calls or parts.reasoning else "")}
        if parts.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parts.reasoning
        if parts.calls:
            first = parser.num_calls - len(parts.calls)
            delta["tool_calls"] = [{"index": first + i} | call.as_openai() for i, call in enumerate(parts.calls)]
        lp = None
        if d.logprobs is not None:
            lp = self._logprobs(list(zip(d.token_ids, d.logprobs)))
        choice = {"index": index, "delta": delta, "logprobs": lp,
                  "finish_reason": self._finish_reason(d.finish_reason, parser.num_calls > 0)}
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_string
        if self.req.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        return choice

    def _choice_out(self, c: CompletionOutput) -> ChatChoice:
        parser = self._new_parser()
        parts = parser.feed(c.text) + parser.finish()
        content, calls, reasoning = self.req.echoed + parts.content, parts.calls, parts.reasoning or None
        message = ChatMessageOut(content=(content.strip() or None) if calls else content, reasoning_content=reasoning,
                                 reasoning=reasoning, tool_calls=[call.as_openai() for call in calls])
        return ChatChoice(index=c.index, message=message,
                          finish_reason=self._finish_reason(c.finish_reason, bool(calls)),
                          logprobs=self._logprobs(list(zip(c.token_ids, c.logprobs))) if c.logprobs else None,
                          stop_reason=c.stop_string, token_ids=list(c.token_ids) if self.req.return_token_ids else None)

    def response(self) -> dict[str, Any]:
        choices = [self._choice_out(c) for c in self.tally.all_choices()]
        return ChatCompletionResponse(id=self.stream.response_id, created=self.stream.created, model=self.stream.model,
                                      choices=choices, usage=self.tally.usage(), **self._prompt_fields()).model_dump()


# ---------------------------------------------------------------- the route


class ChatAPI:
    routes = (Route("POST", "/v1/chat/completions", "create", (ChatCompletionRequest,)),)

    def __init__(self, front: FrontEnd):
        self.front = front

    async def create(self, request: Request) -> Response:
        req, target = await self.front.accept(request, ChatCompletionRequest)
        info = target.model.info
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.front.log_user(base_id, req.user)
        job, parser = await chat_job(f"{base_id}-0", req.chat_turn(chat_template(info)), target, Sampling(
            req, req.requested_max_tokens, info.max_model_len, req.num_logprobs, "messages"))
        fmt = ChatFormatter(base_id, req.model or target.model.name, req, info.tokenizer, parser,
                            job.engine_request.prompt_token_ids)
        return await self.front.respond([job], fmt, req.stream, target)
