"""Tool calls in the Hermes format (vLLM's `hermes` parser reads the same): the tools rendered
into the prompt, the calls a `tool_choice` forces as an output constraint, and the calls parsed
back out of the output. A call is written

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools (it reads `tools`) renders them itself; for one that does not
(the embedded SmolLM2's), the tools go into the system message, earlier calls into the
assistant's text and tool results into `<tool_response>` user turns, the way Hermes-trained
models read them. Torch-free: the ingress uses it as the offline API does.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams, check_json_schema

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# the JSON of forced calls, written as the engine's JSON constraints write it
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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


def forced_calls(tools: list[Tool], choice: str, parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint a `required` or named choice puts on the output: Hermes calls to the
    allowed functions with arguments valid against their parameters (one call when named or
    not `parallel`); None when the model chooses."""
    if choice in ("none", "auto"):
        return None
    allowed = tools if choice == "required" else [t for t in tools if t.name == choice]
    calls = " | ".join(f"%json {json.dumps(_call_schema(t))}" for t in allowed)
    repeat = ' ("\\n" call)*' if parallel and choice == "required" else ""
    return StructuredOutputsParams(grammar=f'start: call{repeat}\ncall: "{_lark(CALL_START)}\\n" ({calls}) '
                                           f'"\\n{_lark(CALL_END)}"')


def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_STYLE}


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# ---------------------------------------------------------------- the prompt


def template_reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def conversation(messages: list[dict], tools: list[Tool], native: bool) -> list[dict]:
    """OpenAI-format messages as the chat template gets them. `native`: the template renders
    tools, calls and tool results itself (calls' arguments as objects, as Hugging Face templates
    take them); otherwise all three become text here."""
    if native:
        return [_native(m) for m in messages]
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
            rendered.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content")] + calls))})
        else:
            rendered.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        block = _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if rendered[0]["role"] == "system":
            rendered[0]["content"] += "\n\n" + block
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered


def _native(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{"id": c.get("id"), "type": "function", "function": _call_dict(c)} for c in message["tool_calls"]]
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


# ---------------------------------------------------------------- the output


class ToolCallParser:
    """Splits an output, as its text arrives, into content and complete calls. The text of a
    call is held until its end tag; a call whose JSON is not a call is content. Whitespace
    between and after calls is dropped."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet returned
        self._space = ""  # whitespace after a call, returned if something else follows
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content that can be returned now and the calls completed by `text`."""
        self._pending += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(CALL_END)
                if end < 0:
                    break
                body, self._pending, self._in_call = self._pending[:end], self._pending[end + len(CALL_END):], False
                call = _call(body)
                if call is None:
                    content.append(CALL_START + body + CALL_END)
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            start = self._pending.find(CALL_START)
            if start >= 0:
                content.append(self._pending[:start])
                self._pending, self._in_call = self._pending[start + len(CALL_START):], True
                continue
            held = _partial_tag(self._pending)
            content.append(self._pending[:len(self._pending) - held])
            self._pending = self._pending[len(self._pending) - held:]
            break
        return self._visible("".join(content)), calls

    def finish(self) -> str:
        """The rest of the content: an unfinished call is text."""
        rest = self._space + (CALL_START if self._in_call else "") + self._pending
        self._pending, self._space, self._in_call = "", "", False
        return rest if rest.strip() or not self.num_calls else ""

    def _visible(self, content: str) -> str:
        if self.num_calls and not content.strip():
            self._space += content
            return ""
        content, self._space = self._space + content, ""
        return content


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None if nothing but calls) and its calls."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content = (content + parser.finish()).strip()
    return (content or None) if calls else content, calls


def _call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall.new(call["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str) -> int:
    """The length of the end of `text` that may begin a call's start tag."""
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0
