"""Tools and tool calls as OpenAI's API has them, checked, and rendered into the prompt: a chat
template that knows tools (it reads `tools`) renders them, earlier calls and their results itself;
for one that does not (the embedded SmolLM2's), the tools go into the system message, earlier calls
into the assistant's text and tool results into `<tool_response>` user turns, in the Hermes format,
the way Hermes-trained models read them. How each family writes calls in its output, and how they
are forced and read back: engine/tool_formats.py. Torch-free: the ingress uses it as the offline
API does.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import check_json_schema

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: OpenAI's `{"type": "function", "function": {...}}`."""
    name: str
    description: str | None
    parameters: dict

    @classmethod
    def parse(cls, spec: Any) -> Tool:
        """From OpenAI's tool object; InvalidRequestError (param "tools") if it is not one."""
        function = spec.get("function") if isinstance(spec, dict) and spec.get("type") == "function" else None
        if not isinstance(function, dict):
            raise InvalidRequestError("tools", 'a tool must be {"type": "function", "function": {...}}')
        name, description = function.get("name"), function.get("description")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError("tools", f"a function name must match [A-Za-z0-9_-]{{1,64}}, got {name!r:.70}")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError("tools", f"the description of {name} must be a string")
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        try:
            check_json_schema(parameters)
        except InvalidRequestError as e:
            raise InvalidRequestError("tools", f"the parameters of {name}: {e.message}") from None
        return cls(name, description, parameters)

    def as_openai(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's responses carry it
    id: str

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(name, arguments, f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(tools: list | None) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "tools must be a list")
    parsed = [Tool.parse(t) for t in tools]
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "tool names must be unique")
    return parsed


def resolve_tool_choice(tool_choice: Any, tools: list[Tool]) -> str:
    """`none`, `auto`, `required`, or the name of the function the output must call; OpenAI's
    default: `auto` with tools, `none` without."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice", 'a named tool_choice is {"type": "function", '
                                                     '"function": {"name": ...}}')
        if name not in {t.name for t in tools}:
            raise InvalidRequestError("tool_choice", f"tool_choice names {name!r:.70}, which is not in tools")
        return name
    if tool_choice not in TOOL_CHOICES:
        raise InvalidRequestError("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a "
                                                 f"named function, got {tool_choice!r:.70}")
    if tool_choice != "none" and not tools:
        raise InvalidRequestError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
    return tool_choice


def forced_tools(tools: list[Tool], choice: str, parallel: bool = True) -> tuple[list[Tool], bool] | None:
    """What a `required` or named choice forces: the tools a call may name, and whether several
    calls may come (`required` with parallel calls); None when the model chooses."""
    if choice in ("none", "auto"):
        return None
    if choice == "required":
        return tools, parallel
    return [t for t in tools if t.name == choice], False


# ---------------------------------------------------------------- the prompt


def template_reads_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def conversation(messages: list[dict], tools: list[Tool], native: bool, short_call_ids: bool = False) -> list[dict]:
    """OpenAI-format messages as the chat template gets them. `native`: the template renders
    tools, calls and tool results itself (calls' arguments as objects, as Hugging Face templates
    take them); otherwise all three become text here. `short_call_ids`: call ids as Mistral's
    templates require them (nine letters and digits), each id mapped the same way wherever it
    stands."""
    if native:
        return [_native(m, short_call_ids) for m in messages]
    rendered: list[dict] = []
    for previous, m in zip([None, *messages], messages):
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if previous is not None and previous["role"] == "tool":  # one user turn for consecutive results
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            calls = [f"{CALL_START}\n{json.dumps(_call_dict(c))}\n{CALL_END}" for c in m["tool_calls"]]
            rendered.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), *calls]))})
        else:
            rendered.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        block = _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if rendered[0]["role"] == "system":
            rendered[0]["content"] += "\n\n" + block
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered


def _native(message: dict, short_call_ids: bool) -> dict:
    def call_id(value: str | None) -> str | None:
        return hashlib.sha256(value.encode()).hexdigest()[:9] if short_call_ids and value is not None else value

    if message.get("tool_call_id") is not None:
        return message | {"tool_call_id": call_id(message["tool_call_id"])}
    if not message.get("tool_calls"):
        return message
    calls = [{"id": call_id(c.get("id")), "type": "function", "function": _call_dict(c)} for c in message["tool_calls"]]
    return message | {"content": message.get("content") or "", "tool_calls": calls}


def _call_dict(call: dict) -> dict:
    """An OpenAI tool call's function with its arguments as an object."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise InvalidRequestError("messages", f"the arguments of the call to {function['name']!r:.70} are not "
                                              "JSON") from None
    return {"name": function["name"], "arguments": arguments}
