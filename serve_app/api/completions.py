"""OpenAI's completions API (`POST /v1/completions`): prompts (texts or token ids, several a
request) as jobs of n samples each, or one beam search a prompt (vLLM's use_beam_search); `echo`
and prompt logprobs; answered as a completion object or its stream of chunks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator, model_validator

from engine.beam_search import BeamSearchParams
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput
from engine.tokenization import all_ints
from serve_app.api.openai_common import Choice, ChunkStream, PromptLogprobs, SamplingFields, Tokens
from serve_app.api.outputs import Tally
from serve_app.api.wire import APIError, Route, Usage
from serve_app.jobs import Sampling, make_job
from serve_app.messages import StreamChunk

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd

# ---------------------------------------------------------------- the request

_NOT_WITH_BEAM_SEARCH = ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "best_of", "logprobs",
                         "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar", "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs",
                         "return_tokens_as_token_ids", "grammar", "json_schema")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all_ints(value)


class CompletionRequest(SamplingFields):
    prompt: Any = Field(description="A string, a list of strings, a list of token ids, or a list of "
                                    "lists of token ids.", json_schema_extra={"anyOf": [
                                        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
                                        {"type": "array", "items": {"type": "integer"}},
                                        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]})
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    use_beam_search: bool = Field(False, description="Beam search (vLLM's): n beams, the n best returned, as "
                                                     "transformers' generate(num_beams=n) finds them.")
    length_penalty: float = Field(1.0, description="With use_beam_search: scores are divided by length ** this.")
    add_special_tokens: bool = Field(True, description="A text prompt's special tokens (BOS) added (vLLM's).")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="Each prompt cut to this many tokens, -1: "
                                                                        "to the context length (vLLM's).")
    truncation_side: Literal["left", "right"] | None = Field(None, description="left (the default): the last tokens "
                                                                               "kept; right: the first.")

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if (isinstance(v, str) and v) or _is_token_ids(v) or (
                isinstance(v, list) and v and (all(isinstance(p, str) and p for p in v)
                                               or all(_is_token_ids(p) for p in v))):
            return v
        raise ValueError("prompt must be a non-empty string, a list of non-empty strings, a list of token "
                         "ids (ints), or a list of such lists")

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompt_logprobs_computed(self) -> int | None:
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked, default=None)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """Refuses a field beam search would not apply (it is deterministic: temperature 0 only)."""
        given = self.model_fields_set
        if not self.use_beam_search:
            if "length_penalty" in given:
                raise InvalidRequestError("length_penalty", "length_penalty applies to beam search only "
                                                            "(use_beam_search)")
            return None
        defaults = type(self).model_fields
        unapplied = [f for f in _NOT_WITH_BEAM_SEARCH if f in given and getattr(self, f) != defaults[f].default]
        if "temperature" in given and self.temperature != 0:
            unapplied.insert(0, "temperature")
        if unapplied:
            raise InvalidRequestError(unapplied[0], f"{unapplied[0]} does not apply to beam search (use_beam_search)")
        return BeamSearchParams(self.n, max_tokens, self.length_penalty, self.ignore_eos)

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens and truncation_side keep it."""
        if self.truncate_prompt_tokens is None:
            return prompt_ids
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        return [p] if isinstance(p, str) or _is_token_ids(p) else list(p)


# ---------------------------------------------------------------- the output


class CompletionChoice(Choice):
    text: str
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionFormatter:
    """With `echo`, each choice's text starts with its prompt's (streamed: in its first chunk), and
    with `logprobs` too, its logprobs start with the prompt tokens' (the first one's null). vLLM's
    prompt_logprobs and prompt_token_ids come in a choice's first chunk, its token_ids in each."""

    def __init__(self, response_id: str, model: str, req: CompletionRequest, tokenizer: Any,
                 prompt_ids: list[list[int]]):
        self.req, self.tokenizer, self.prompt_ids = req, tokenizer, prompt_ids
        self.tokens = Tokens(tokenizer, req.return_tokens_as_token_ids)
        self.tally = Tally(len(prompt_ids) * req.n)
        self.stream = ChunkStream(response_id, "text_completion", model, req.stream_options, self.tally)
        self._started: set[int] = set()
        self._prompt_logprobs: dict[int, PromptLogprobs] = {}  # by prompt index

    def _take(self, chunk: StreamChunk, offset: int) -> None:
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs[offset // self.req.n] = chunk.prompt_logprobs

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self.tally.add(chunk, offset)
        self._take(chunk, offset)

    def stream_text(self, chunk: StreamChunk, offset: int) -> str:
        self.tally.count(chunk, offset)
        self._take(chunk, offset)
        return "".join(self.stream.chunk(self._stream_choice(offset + d.index, d)) for d in chunk.outputs)

    def stream_end(self) -> str:
        return self.stream.end()

    def stream_error(self, error: APIError) -> str:
        return self.stream.error(error)

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts()[index // self.req.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _logprobs(self, pairs: PromptLogprobs) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets, pos = [], [], [], [], 0
        k = self.req.logprobs or 0
        for token_id, entries in pairs:
            s = self.tokens(token_id)
            tokens.append(s)
            token_logprobs.append(entries.get(token_id) if entries is not None else None)
            # the token itself, then the k likeliest (vLLM's: logprobs 0 gives the token alone)
            top.append(None if entries is None else {s: entries[token_id]} | {
                self.tokens(t): lp for t, lp in self.tokens.top(entries, k)})
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _choice_logprobs(self, index: int, c: CompletionOutput, first: bool) -> dict[str, Any] | None:
        """The choice's (new) tokens' logprobs, after its prompt's in its first part when echoed."""
        if c.logprobs is None:
            return None
        echoed = self._prompt_logprobs.get(index // self.req.n, []) if first and self.req.echo else []
        return self._logprobs(echoed + list(zip(c.token_ids, c.logprobs)))

    def _vllm_fields(self, index: int, c: CompletionOutput, first: bool) -> dict[str, Any]:
        """vLLM's fields of a choice: the prompt's in its first part (None where not asked), its
        new tokens' ids with return_token_ids."""
        prompt = index // self.req.n
        asked = self.req.prompt_logprobs
        return {"stop_reason": c.stop_string,
                "prompt_logprobs": self.tokens.prompt_logprobs(self._prompt_logprobs.get(prompt, []), asked)
                if first and asked is not None else None,
                "prompt_token_ids": self.prompt_ids[prompt] if first and self.req.return_token_ids else None,
                "token_ids": list(c.token_ids) if self.req.return_token_ids else None}

    def _stream_choice(self, index: int, d: CompletionOutput) -> dict[str, Any]:
        first = index not in self._started
        self._started.add(index)
        text = (self._echo(index) if first else "") + d.text
        return {"index": index, "text": text, "logprobs": self._choice_logprobs(index, d, first),
                "finish_reason": d.finish_reason, **self._vllm_fields(index, d, first)}

    def response(self) -> dict[str, Any]:
        choices = [
            CompletionChoice(index=c.index, text=self._echo(c.index) + c.text, finish_reason=c.finish_reason,
                             logprobs=self._choice_logprobs(c.index, c, True), **self._vllm_fields(c.index, c, True))
            for c in self.tally.all_choices()
        ]
        return CompletionResponse(id=self.stream.response_id, created=self.stream.created, model=self.stream.model,
                                  choices=choices, usage=self.tally.usage()).model_dump()


# ---------------------------------------------------------------- the route


class CompletionsAPI:
    routes = (Route("POST", "/v1/completions", "create", (CompletionRequest,)),)

    def __init__(self, front: FrontEnd):
        self.front = front

    async def create(self, request: Request) -> Response:
        req, target = await self.front.accept(request, CompletionRequest)
        model, prompts = target.model, req.prompts()
        self.front.check_num_prompts(len(prompts), "prompt")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        self.front.log_user(base_id, req.user)
        def ids(prompt: str | list[int]) -> Awaitable[list[int]]:
            return model.prompt_ids(prompt, add_special_tokens=req.add_special_tokens)

        prompt_ids = [req.truncated(p, model.info.max_model_len) for p in (
            [await ids(prompts[0])] if len(prompts) == 1 else await asyncio.gather(*map(ids, prompts)))]
        sampling = Sampling(req, req.requested_max_tokens, self.front.config.ingress.default_completion_max_tokens,
                            req.logprobs)
        jobs = [make_job(f"{base_id}-{i}", ids, target, sampling, i * req.n) for i, ids in enumerate(prompt_ids)]
        fmt = CompletionFormatter(base_id, req.model or model.name, req, model.info.tokenizer, prompt_ids)
        return await self.front.respond(jobs, fmt, req.stream, target)
