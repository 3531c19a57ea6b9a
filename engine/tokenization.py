"""Prompts to token ids, and the rules a prompt must satisfy: the one home of templating, prompt
tokenization, the context-length check and the vocabulary checks (prompt ids, logit_bias). The
engine applies them when a request arrives as text; the serve app's ingress applies the same
functions at its edge, tokenizes each prompt once and sends the engine the token ids. Torch-free.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tool_formats import tool_format_for
from engine.tools import Tool, conversation, template_reads_tools


def encode_text(tokenizer, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    check_text(text, param)
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # e.g. a lone surrogate the tokenizer cannot take
        raise untokenizable(param, e) from None


def check_text(text: str, param: str = "prompt") -> None:
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(param, f"{param} must be a non-empty string")


def untokenizable(param: str, error: Exception) -> InvalidRequestError:
    return InvalidRequestError(param, f"{param} could not be tokenized: {error}")


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[Tool] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """`render_chat`'s text tokenized as transformers' `apply_chat_template` tokenizes it: the
    template writes every special token, so none is added."""
    return encode_text(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, tools, template_kwargs),
                       add_special_tokens=False, param="messages")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[Tool] | None = None, template_kwargs: dict[str, Any] | None = None,
                continue_final_message: bool = False) -> str:
    """The chat template applied to OpenAI-format messages (tool calls and results included),
    with the `tools` offered and the assistant's generation prompt unless told otherwise, or
    (`continue_final_message`) the last message left open for the output to go on with.
    `template_kwargs`: variables for the template (`enable_thinking`, `reasoning_effort`), passed
    as given, as vLLM passes them: the template renders those it reads (clients send Qwen3's
    `enable_thinking` to every model)."""
    if not messages:
        raise InvalidRequestError("messages", "messages must not be empty")
    template = getattr(tokenizer, "chat_template", None) or ""
    native = template_reads_tools(template)
    extra: dict[str, Any] = {"tools": [t.as_openai() for t in tools]} if native and tools else {}
    if continue_final_message:
        extra["continue_final_message"] = True
    messages = conversation(messages, tools or [], native, short_call_ids=tool_format_for(template) == "mistral")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **extra, **(template_kwargs or {}))
    except Exception as e:  # the template refuses the conversation (roles, order, content)
        raise InvalidRequestError("messages", f"could not apply the chat template: {e}") from None


_INT = frozenset([int])


def all_ints(values: Iterable[Any]) -> bool:
    """Every value of type int, so no bool (JSON's true is no token id); a loop in C, as a
    prompt's ids are checked on every request."""
    return _INT.issuperset(map(type, values))


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt",
                    name: str = "prompt_token_ids") -> None:
    """`param`: the request field at fault; `name`: the ids as the message calls them."""
    if not token_ids:
        raise InvalidRequestError(param, f"{name} must not be empty")
    if all_ints(token_ids) and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(param, f"{name}: {bad[:5]} outside the vocabulary [0, {vocab_size})")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError("logit_bias", f"logit_bias: token ids {bad[:5]} outside the vocabulary "
                                                f"[0, {vocab_size})")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "prompt"
                         ) -> None:
    """The prompt plus `max_tokens` must fit in max_model_len (OpenAI's rule, for requests that
    state max_tokens); with max_tokens None the prompt must leave room for one token, and
    generation stops at max_model_len (the offline API's rule)."""
    wanted = num_prompt_tokens + (1 if max_tokens is None else max_tokens)
    if wanted > max_model_len:
        raise InvalidRequestError(
            param, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{wanted} tokens ({num_prompt_tokens} in the prompt, {wanted - num_prompt_tokens} in the "
                   f"completion). Please reduce the prompt or max_tokens.", code="context_length_exceeded")
