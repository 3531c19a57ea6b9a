"""OpenAI's Responses API (`POST /v1/responses`, and GET, DELETE, cancel and input_items by id): the
request as a chat turn (its input items as OpenAI chat messages, the engine's templating, tools,
structured outputs and reasoning as for chat completions), its output as output items (reasoning,
a message, function calls), streamed as the API's typed events in their order, and the responses
kept for `previous_response_id` and GET.

Kept responses live in this ingress replica's memory (`ResponseStore`, bounded, least recently
used dropped first): with several ingress replicas a later request may reach a replica that does
not hold one, and gets a 404 saying so. `background: true` runs the response in this process
after the POST has answered; GET shows it as it goes, cancel ends it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Discriminator, Field, Tag, model_validator

from engine.chat_output import ChatOutputParser
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.api.chat_turn import ChatTurn, ToolUse, chat_job, chat_template, named, template_variable
from serve_app.api.openai_common import JsonSchemaFormat, Tokens
from serve_app.api.outputs import Block, OutputBlocks, Tally
from serve_app.api.wire import APIError, Route, WireModel
from serve_app.jobs import Job, Sampling, Target, complete
from serve_app.messages import StreamChunk

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd

logger = logging.getLogger("cbserve.ingress")

# ---------------------------------------------------------------- the request


class InputText(WireModel):
    type: Literal["input_text"]
    text: str


class OutputText(WireModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(WireModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(WireModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(WireModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")

    def as_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type", "strict"}, exclude_none=True)}


class NamedFunction(WireModel):
    type: Literal["function"]
    name: str


class TextFormatText(WireModel):
    type: Literal["text"]


class TextFormatJsonObject(WireModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    type: Literal["json_schema"]


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(WireModel):
    format: TextFormat | None = None


class ReasoningConfig(WireModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Reaches the chat template as reasoning_effort, where the template takes it.")


class ResponsesRequest(WireModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="message.output_text.logprobs: each output_text token's logprob and its top_logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(None, description="'auto' is not implemented.")
    priority: int | None = Field(None, description="Lower is served sooner; None: the API key's default.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables the chat template reads, such "
                                                                          "as enable_thinking (vLLM's).")

    @model_validator(mode="after")
    def _modes(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true)")
        if self.background and self.stream:
            raise ValueError("a background response is not streamed: GET it by its id")
        return self

    @cached_property
    def tool_use(self) -> ToolUse:
        choice = named(self.tool_choice.name) if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        return ToolUse.of([t.as_chat() for t in self.tools or []], choice, self.parallel_tool_calls)

    def template_kwargs(self, template: str) -> dict[str, Any]:
        """chat_template_kwargs, and reasoning.effort as the template's reasoning_effort where the
        template takes it."""
        given = self.chat_template_kwargs or {}
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return given
        return given | template_variable("reasoning_effort", effort, template, "reasoning.effort")

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        fmt = self.text.format if self.text is not None else None
        constraint = None
        if isinstance(fmt, TextFormatJsonObject):
            constraint = StructuredOutputsParams(json_object=True)
        elif isinstance(fmt, TextFormatJsonSchema):
            constraint = StructuredOutputsParams(json=fmt.schema_) if fmt.schema_ is not None \
                else StructuredOutputsParams(json_object=True)
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              structured_outputs=constraint, logprobs=self.num_logprobs)

    @property
    def num_logprobs(self) -> int | None:
        """The top logprobs of each output token, where `include` asks for the text's logprobs."""
        return (self.top_logprobs or 0) if self.include else None

    def beam_search_params(self, max_tokens: int) -> None:
        return None

    def input_items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) \
            else self.tool_choice or "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": self.reasoning.effort if self.reasoning else None, "summary": None},
                "store": self.store, "temperature": self.temperature, "text": {"format": fmt}, "tool_choice": choice,
                "top_logprobs": self.top_logprobs,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []], "top_p": self.top_p,
                "truncation": "disabled", "user": self.user, "metadata": self.metadata or {},
                "background": self.background}


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as OpenAI chat messages (engine.tokenization.render_chat's): messages as they
    are, a reasoning item on the assistant turn after it, consecutive function calls one
    assistant turn's tool_calls (with the text before them), each output a tool message."""
    messages: list[dict[str, Any]] = []
    reasoning = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
                continue
            message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            message = {"role": "system" if item.role == "developer" else item.role, "content": item.text()}
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = message["thinking"] = reasoning
            reasoning = None
        messages.append(message)
    return messages


# ---------------------------------------------------------------- kept responses


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as GET returns it
    history: list[dict[str, Any]]  # the conversation through its output, as chat messages (no instructions)
    input_items: list[dict[str, Any]]
    task: asyncio.Task | None = None  # a background response still running


@dataclass
class ResponseStore:
    """The responses kept for previous_response_id and GET, the least recently used dropped first."""
    capacity: int
    num_ingress_replicas: int = 1
    _kept: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._kept[response_id] = stored
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._kept.get(response_id)
        if stored is None:
            where = (f"; responses are kept in the memory of the ingress replica that answered them, and this app "
                     f"has {self.num_ingress_replicas}" if self.num_ingress_replicas > 1 else "")
            raise APIError(404, f"Response with id '{response_id}' not found (at most {self.capacity} responses are "
                                f"kept, the least recently used dropped first{where}).", param=param, code="not_found")
        self._kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self._kept[response_id]
        return stored


# ---------------------------------------------------------------- the output


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter:
    """A response object from the engine's chunks, or its stream of typed events; `on_complete`
    gets the finished response object (to be kept)."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, tokenizer: Any,
                 output_parser: Callable[[], ChatOutputParser],
                 on_complete: Callable[[dict[str, Any], list[Block]], None]):
        self.response_id, self.model, self.req, self.tokenizer = response_id, model, req, tokenizer
        self.tally = Tally(1)
        self._tokens = Tokens(tokenizer, as_ids=False)
        self._logprobs: list[dict[str, Any]] = []  # the text's tokens', with include's logprobs
        self._unsent: list[dict[str, Any]] = []  # those a text delta event has not carried yet
        self._on_complete = on_complete
        self._parser = output_parser()
        self._blocks = OutputBlocks()
        self._ids: dict[int, str] = {}  # block index -> its item id
        self._sequence = 0
        self._started = False
        self._finish_reason: str | None = None
        self.created = int(time.time())

    # ------------------------------------------------------------ the response object

    def skeleton(self, status: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": [], "usage": None,
                **self.req.echo()}

    def _item(self, block: Block, done: bool) -> dict[str, Any]:
        item_id = self._ids.setdefault(block.index, _new_id({"reasoning": "rs", "text": "msg", "call": "fc"}
                                                            [block.kind]))
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": [_output_text(block.text, self._logprobs)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.tool_call.id, "name": block.tool_call.name,
                "arguments": block.text if done else "", "status": status}

    def _final(self) -> dict[str, Any]:
        incomplete = self._finish_reason == "length"
        body = self.skeleton("incomplete" if incomplete else "completed")
        body["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        body["output"] = [self._item(block, done=True) for block in self._blocks.blocks]
        usage = self.tally.usage()
        reasoning = sum(len(self.tokenizer.encode(b.text, add_special_tokens=False))
                        for b in self._blocks.blocks if b.kind == "reasoning")
        body["usage"] = {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": usage.completion_tokens,
                         "output_tokens_details": {"reasoning_tokens": min(reasoning, usage.completion_tokens)},
                         "total_tokens": usage.total_tokens}
        self._on_complete(body, self._blocks.blocks)
        return body

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self.tally.add(chunk, offset)

    def response(self) -> dict[str, Any]:
        choice = self.tally.choice(0)
        self._finish_reason = choice.finish_reason
        self._take_logprobs(choice)
        self._blocks.feed(self._parser.feed(choice.text) + self._parser.finish())
        self._blocks.close()
        return self._final()

    # ------------------------------------------------------------ the stream

    def _event(self, kind: str, **fields: Any) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        self.tally.count(chunk, offset)
        text = ""
        if not self._started:
            self._started = True
            text += self._event("response.created", response=self.skeleton("in_progress"))
            text += self._event("response.in_progress", response=self.skeleton("in_progress"))
        for d in chunk.outputs:
            delta = self._parser.feed(d.text)
            if d.finish_reason is not None:
                delta += self._parser.finish()
                self._finish_reason = d.finish_reason
            self._take_logprobs(d)
            text += "".join(self._events(*event) for event in self._blocks.feed(delta))
        return text

    def _take_logprobs(self, output: CompletionOutput) -> None:
        """An output's tokens' logprobs, as the Responses API shows them (a model whose output is
        the text alone: no reasoning section, no tools; the route checks)."""
        if output.logprobs is None:
            return
        entries = self._tokens.entries(zip(output.token_ids, output.logprobs), self.req.top_logprobs or 0)
        self._logprobs += entries
        self._unsent += entries

    def _events(self, change: str, block: Block, grown: str) -> str:
        index, item_id = block.index, None
        if change == "open":
            item = self._item(block, done=False)
            text = self._event("response.output_item.added", output_index=index, item=item)
            if block.kind != "call":
                part = _output_text("") if block.kind == "text" else {"type": "reasoning_text", "text": ""}
                text += self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)
            return text
        item_id = self._ids[index]
        where = {"item_id": item_id, "output_index": index}
        if change == "delta":
            if block.kind == "text":
                logprobs, self._unsent = self._unsent, []
                return self._event("response.output_text.delta", **where, content_index=0, delta=grown,
                                   logprobs=logprobs)
            if block.kind == "reasoning":
                return self._event("response.reasoning_text.delta", **where, content_index=0, delta=grown)
            return self._event("response.function_call_arguments.delta", **where, delta=grown)
        if block.kind == "call":
            text = self._event("response.function_call_arguments.done", **where, name=block.tool_call.name,
                               arguments=block.text)
        else:
            kind = "output_text" if block.kind == "text" else "reasoning_text"
            done = {"text": block.text, "logprobs": self._logprobs} if block.kind == "text" else {"text": block.text}
            text = self._event(f"response.{kind}.done", **where, content_index=0, **done)
            part = _output_text(block.text, self._logprobs) if block.kind == "text" \
                else {"type": "reasoning_text", "text": block.text}
            text += self._event("response.content_part.done", **where, content_index=0, part=part)
        return text + self._event("response.output_item.done", output_index=index, item=self._item(block, done=True))

    def stream_end(self) -> str:
        text = "".join(self._events(*event) for event in self._blocks.close())
        body = self._final()
        return text + self._event(f"response.{body['status']}", response=body)

    def stream_error(self, error: APIError) -> str:
        failed = self.skeleton("failed") | {"error": {"code": error.code or "server_error", "message": error.message}}
        return (self._event("error", code=error.code, message=error.message, param=error.param)
                + self._event("response.failed", response=failed))


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def output_history(blocks: list[Block]) -> dict[str, Any]:
    """A response's output as the assistant's chat message (what a later turn's template reads)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
    calls = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
             for call in (b.tool_call for b in blocks if b.kind == "call")]
    if calls:
        message["tool_calls"] = calls
    reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
    if reasoning:
        message["reasoning_content"] = message["thinking"] = reasoning
    return message


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as input_items lists them: each with an id."""
    listed = []
    for item in items:
        entry = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            entry["content"] = [{"type": "input_text" if item.role != "assistant" else "output_text",
                                 "text": item.content}]
        entry.setdefault("id", _new_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                        "reasoning": "rs"}[entry.get("type", "message")]))
        entry.setdefault("type", "message")
        listed.append(entry)
    return listed


# ---------------------------------------------------------------- the routes


class ResponsesAPI:
    routes = (Route("POST", "/v1/responses", "create", (ResponsesRequest,)),
              Route("GET", "/v1/responses/{response_id}", "get"),
              Route("DELETE", "/v1/responses/{response_id}", "delete"),
              Route("POST", "/v1/responses/{response_id}/cancel", "cancel"),
              Route("GET", "/v1/responses/{response_id}/input_items", "input_items"))

    def __init__(self, front: FrontEnd):
        self.front = front
        ingress = front.config.ingress
        self.store = ResponseStore(ingress.max_stored_responses, ingress.num_replicas)

    async def create(self, request: Request) -> Response:
        """One chat turn over the items given, after a kept response's conversation where
        previous_response_id names one."""
        req, target = await self.front.accept(request, ResponsesRequest)
        info = target.model.info
        response_id = f"resp_{uuid.uuid4().hex}"
        self.front.log_user(response_id, req.user)
        items = req.input_items()
        history = self.store.get(req.previous_response_id, "previous_response_id").history \
            if req.previous_response_id is not None else []
        conversation = history + chat_messages(items)
        instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
        if not conversation:
            raise APIError(400, "input must hold at least one item", param="input")
        if req.include and (info.chat_format.reasoning is not None or req.tool_use.may_call):
            raise APIError(400, "include: message.output_text.logprobs needs an output that is the text alone: this "
                                "model writes a reasoning section, or tools are offered", param="include")
        turn = ChatTurn(instructions + conversation, req.tool_use, req.template_kwargs(chat_template(info)))
        job, parser = await chat_job(response_id, turn, target, Sampling(req, req.max_output_tokens,
                                                                         info.max_model_len, param="input"))
        kept = StoredResponse({}, [], stored_items(items))

        def keep(body: dict[str, Any], blocks: list[Block]) -> None:
            kept.body, kept.history = body, conversation + [output_history(blocks)]

        fmt = ResponsesFormatter(response_id, req.model or target.model.name, req, info.tokenizer, parser, keep)
        if req.store:
            self.store.put(response_id, kept)
        if req.background:
            self.front.check_fits_queue([job])
            kept.body = fmt.skeleton("queued")
            kept.task = asyncio.ensure_future(self._background(job, fmt, kept, target))
            return JSONResponse(kept.body)
        return await self.front.respond([job], fmt, req.stream, target)

    async def _background(self, job: Job, fmt: ResponsesFormatter, kept: StoredResponse, target: Target) -> None:
        """A background response run to its end in this process, its state kept as it goes."""
        kept.body = fmt.skeleton("in_progress")
        try:
            await complete([job], fmt, self.front.admission, target.model.replicas)  # its size checked at the POST
        except asyncio.CancelledError:
            kept.body = fmt.skeleton("cancelled")
        except APIError as e:
            kept.body = fmt.skeleton("failed") | {"error": {"code": e.code or "server_error", "message": e.message}}
        except Exception as e:
            logger.exception("background response %s failed", fmt.response_id)
            kept.body = fmt.skeleton("failed") | {"error": {"code": "server_error", "message": type(e).__name__}}
        finally:
            kept.task = None

    async def get(self, response_id: str, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        return self.store.get(response_id, "response_id").body

    async def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        kept = self.store.delete(response_id)
        if kept.task is not None:
            kept.task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        kept = self.store.get(response_id, "response_id")
        if kept.task is None:
            raise APIError(400, f"Response '{response_id}' is not a background response still running: only "
                                "those can be cancelled.", param="response_id")
        kept.task.cancel()
        await asyncio.gather(kept.task, return_exceptions=True)
        return kept.body

    async def input_items(self, response_id: str, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        items = self.store.get(response_id, "response_id").input_items
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}
