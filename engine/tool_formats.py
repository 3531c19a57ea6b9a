"""How each model family writes tool calls, used both ways: the grammar a forced call puts on the
output (the calls to the allowed functions, arguments valid against their parameters) and the
parser that reads calls back out of the text, whole or as it streams. vLLM's parsers of the same
names read the same formats:

- `hermes` (Qwen 2.5 and 3, SmolLM, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  per call;
- `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or bare, the
  whole message, calls joined by "; ";
- `mistral` (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `harmony` (gpt-oss): a commentary message addressed to `functions.NAME` (engine/harmony.py).

A marker the tokenizer holds as a token of its own (an added token) is written into grammars as
that token (`Markers`); one it holds as a special token is read from text decoded with special
tokens kept. Torch-free.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.tools import CALL_END, CALL_START, Tool, ToolCall

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# how the engine's JSON constraints write JSON (engine/grammar.py), forced calls' too
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Markers:
    """The formats' markers the tokenizer holds as added tokens (grammar engines take those as
    tokens, never as the bytes of their text), and which of them are special (left out of text
    decoded without special tokens)."""
    tokens: dict[str, int] = field(default_factory=dict)
    special: frozenset[str] = frozenset()

    def lark(self, text: str) -> str:
        """`text` as a Lark item: its token, or the string."""
        token = self.tokens.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def skipped(self, texts: tuple[str, ...]) -> bool:
        """Some of `texts` vanish from text decoded without special tokens."""
        return any(t in self.special for t in texts)


def call_json(tool: Tool, arguments_key: str) -> str:
    """A Lark item: one call to `tool` as a JSON object, its arguments valid against its parameters
    (their local references, `#/$defs/...` or `#` itself, pointing where the parameters now sit)."""
    arguments = rerooted(tool.parameters, f"#/properties/{arguments_key}")
    schema = {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: arguments},
              "required": ["name", arguments_key], "additionalProperties": False, "x-guidance": JSON_STYLE}
    return f"%json {json.dumps(schema)}"


_VALUES = frozenset(["const", "enum", "default", "examples"])  # JSON values, not schemas: no reference in them


def rerooted(schema: object, at: str) -> object:
    """`schema` with its local `$ref`s rewritten for it to sit at the JSON pointer `at` of a larger
    schema (what pydantic's and zod's nested and recursive models refer by)."""
    if isinstance(schema, list):
        return [rerooted(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: (at + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                  else value if key in _VALUES else rerooted(value, at)) for key, value in schema.items()}


def args_json(tool: Tool) -> str:
    """A Lark item: arguments valid against `tool`'s parameters."""
    return f"%json {json.dumps(tool.parameters | {'x-guidance': JSON_STYLE})}"


def call_from_json(value: object) -> ToolCall | None:
    """A call from its decoded JSON ({"name", "arguments" or "parameters"}); None if it is not one."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall.new(value["name"], json.dumps(arguments, ensure_ascii=False))


def partial_suffix(text: str, tag: str) -> int:
    """The length of the end of `text` that may begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CallParser:
    """Splits an output, as its text arrives, into content and complete calls; `finish` returns
    what it held (a call never completed is content). Whitespace between and after calls is
    dropped, so content is None-worthy when only calls came."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._space = ""  # whitespace after a call, returned if something else follows

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = self._feed(text)
        self.num_calls += len(calls)
        return self._visible(content), calls

    def finish(self) -> str:
        rest = self._space + self._rest()
        self._space = ""
        return rest if rest.strip() or not self.num_calls else ""

    def _visible(self, content: str) -> str:
        if self.num_calls and not content.strip():
            self._space += content
            return ""
        content, self._space = self._space + content, ""
        return content

    def _feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _rest(self) -> str:
        raise NotImplementedError


class TaggedCallParser(CallParser):
    """Calls each between a start and an end tag (Hermes); a call whose JSON is not one is content."""

    def __init__(self, start: str, end: str) -> None:
        super().__init__()
        self.start, self.end = start, end
        self._pending, self._in_call = "", False

    def _feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(self.end)
                if end < 0:
                    break
                body, self._pending, self._in_call = self._pending[:end], self._pending[end + len(self.end):], False
                call = _decoded_call(body)
                if call is None:
                    content.append(self.start + body + self.end)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(self.start)
            if start >= 0:
                content.append(self._pending[:start])
                self._pending, self._in_call = self._pending[start + len(self.start):], True
                continue
            held = partial_suffix(self._pending, self.start)
            content.append(self._pending[:len(self._pending) - held])
            self._pending = self._pending[len(self._pending) - held:]
            break
        return "".join(content), calls

    def _rest(self) -> str:
        rest = (self.start if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest


class JsonCallsParser(CallParser):
    """Calls as JSON that makes up the whole message after an optional lead marker (Llama 3's
    `<|python_tag|>`, Mistral's `[TOOL_CALLS]`): JSON objects joined by `separator`, or (`array`)
    one JSON array of them. A message that does not start so is content; held JSON that never
    becomes calls is too."""

    def __init__(self, lead: str, lead_required: bool, array: bool, separator: str = ";") -> None:
        super().__init__()
        self.lead, self.lead_required, self.array, self.separator = lead, lead_required, array, separator
        self._mode = ""  # "" undecided, "text", "calls"
        self._held = ""  # text of the calls part not yet parsed
        self._parsed_any = False

    def _feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._held += text
        if not self._mode:
            lead = self._held.lstrip()
            if lead.startswith(self.lead):
                self._mode, self._held = "calls", lead[len(self.lead):]
            elif not self.lead_required and lead.startswith("[" if self.array else "{"):
                self._mode, self._held = "calls", lead
            elif not lead or self.lead.startswith(lead):
                return "", []
            else:
                self._mode, held, self._held = "text", self._held, ""
                return held, []
        return "", self._parse()

    def _parse(self) -> list[ToolCall]:
        decoder, calls = json.JSONDecoder(), list[ToolCall]()
        while True:
            body = self._held.lstrip().lstrip(self.separator).lstrip()
            if not body:
                return calls
            try:
                value, end = decoder.raw_decode(body)
            except ValueError:
                return calls  # incomplete (or never JSON: finish returns it)
            found = [call_from_json(v) for v in (value if self.array and isinstance(value, list) else [value])]
            parsed = [call for call in found if call is not None]
            if not found or len(parsed) < len(found):
                return calls
            calls += parsed
            self._parsed_any, self._held = True, body[end:]

    def _rest(self) -> str:
        rest, self._held = self._held, ""
        if self._mode == "calls" and not self._parsed_any:
            return (self.lead if rest and self.lead_required else "") + rest
        return rest.strip() and rest


def _decoded_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


class ToolFormat:
    """One family's call format: its grammar for forced calls and its parser."""
    name = ""

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts that may be special tokens (decoded with special tokens kept)."""
        return ()

    def calls_grammar(self, tools: list[Tool], parallel: bool, markers: Markers) -> str:
        """Lark rules whose `start` is the calls: one to any of `tools`, or (`parallel`) one or more."""
        raise NotImplementedError

    def parser(self) -> CallParser:
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    start, end = CALL_START, CALL_END

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end)

    def calls_grammar(self, tools: list[Tool], parallel: bool, markers: Markers) -> str:
        calls = " | ".join(call_json(t, "arguments") for t in tools)
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: {markers.lark(self.start)} "\\n" ({calls}) "\\n" {markers.lark(self.end)}')

    def parser(self) -> CallParser:
        return TaggedCallParser(self.start, self.end)


@dataclass(frozen=True, kw_only=True)
class JsonCalls(ToolFormat):
    """Calls as JSON making up the whole message after a lead marker: objects joined by a
    separator (Llama 3, its lead optional), or one array of them (Mistral, its lead required)."""
    name: str
    lead: str
    lead_required: bool
    array: bool
    arguments_key: str  # "parameters" (Llama 3) or "arguments"

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.lead,)

    def calls_grammar(self, tools: list[Tool], parallel: bool, markers: Markers) -> str:
        calls = " | ".join(call_json(t, self.arguments_key) for t in tools)
        repeat = f" ({json.dumps(', ' if self.array else '; ')} call)*" if parallel else ""
        body = f'{markers.lark(self.lead)} "[" call{repeat} "]"' if self.array else f"call{repeat}"
        return f"start: {body}\ncall: {calls}"

    def parser(self) -> CallParser:
        return JsonCallsParser(self.lead, self.lead_required, self.array)


LLAMA3_JSON = JsonCalls(name="llama3_json", lead="<|python_tag|>", lead_required=False, array=False,
                        arguments_key="parameters")
MISTRAL = JsonCalls(name="mistral", lead="[TOOL_CALLS]", lead_required=True, array=True, arguments_key="arguments")
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), LLAMA3_JSON, MISTRAL)}


def tool_format_for(chat_template: str | None) -> str:
    """The format a chat template writes calls in, by the marker it renders; Hermes by default
    (the format tools are rendered into a template that knows none in: engine.tools.conversation)."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return "hermes"
