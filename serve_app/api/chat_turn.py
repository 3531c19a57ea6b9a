"""One chat turn, as chat completions, the Responses API and Anthropic's Messages API each ask
for it: the tools offered and the tool-choice rule, the template's variables, and the turn's job
(its messages through the model's chat template, its sampling a chat turn's in the model's format,
engine.chat_output) with the parser its output is read with.

Each API maps its own spelling onto OpenAI chat's (messages, tools, tool_choice), and the rules
live here once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.chat_output import ChatOutputParser
from engine.tools import Tool, forced_tools, parse_tools, resolve_tool_choice
from serve_app.api.wire import APIError
from serve_app.jobs import Job, Sampling, Target, make_job
from serve_app.messages import ModelInfo

ToolChoice = str | dict[str, Any] | None  # OpenAI chat's tool_choice: none, auto, required or a named function


def named(function: str) -> dict[str, Any]:
    """OpenAI chat's tool_choice that forces a call of `function`."""
    return {"type": "function", "function": {"name": function}}


@dataclass(frozen=True)
class ToolUse:
    """The tools a turn offers and how its output may call them."""
    offered: list[Tool]
    chosen: str  # none, auto, required, or the name of the function the output must call
    forced: tuple[list[Tool], bool] | None  # the tools a forced call may name, and whether several may come

    @classmethod
    def of(cls, tools: list[dict[str, Any]], choice: ToolChoice = None, parallel: bool = True) -> ToolUse:
        """`tools` as OpenAI chat's, each parameters schema checked against its metaschema; with
        no choice, OpenAI's default (auto with tools, none without)."""
        offered = parse_tools(tools)
        chosen = resolve_tool_choice(choice, offered)
        return cls(offered, chosen, forced_tools(offered, chosen, parallel))

    @property
    def may_call(self) -> bool:
        return self.chosen != "none"

    @property
    def model_chooses(self) -> bool:
        """Whether the model chose to call (auto or required), rather than being told which."""
        return self.chosen in ("auto", "required")


def template_variable(name: str, value: Any, template: str, param: str) -> dict[str, Any]:
    """A request field that reaches the chat template as the variable `name` (reasoning effort,
    thinking), or a 400 naming the field where the model's template does not read it."""
    if name not in template:
        raise APIError(400, f"{param}: this model's chat template takes no {name.replace('_', ' ')}", param=param)
    return {name: value}


def chat_template(info: ModelInfo) -> str:
    """The model's chat template: what a request's template variables are checked against."""
    return getattr(info.tokenizer, "chat_template", None) or ""


@dataclass(frozen=True)
class ChatTurn:
    """A turn's prompt as the template takes it: OpenAI chat messages, tools and variables, and
    where the output starts (a new assistant message, or the last message continued)."""
    messages: list[dict[str, Any]]
    tools: ToolUse
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False


async def chat_job(job_id: str, turn: ChatTurn, target: Target, sampling: Sampling
                   ) -> tuple[Job, Callable[[], ChatOutputParser]]:
    """The turn's job, and a maker of the parser its output is read with."""
    info, tools = target.model.info, turn.tools
    text, ids = await target.model.chat_prompt(turn.messages, tools.offered, turn.add_generation_prompt,
                                               turn.template_kwargs, turn.continue_final_message)
    as_turn = dataclasses.replace(sampling, chat_turn=lambda params: info.chat_format.sampling_params(
        params, text, tools.forced, tools.may_call))
    return make_job(job_id, ids, target, as_turn, 0), lambda: info.chat_format.parser(
        text, tools.may_call, tools.forced is not None)
