"""gpt-oss's harmony format: an output is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

(after the generation prompt `<|start|>assistant`). The analysis channel is the reasoning, the
final channel the answer, and a commentary message addressed to `functions.NAME` (in its header,
before or after the channel) a tool call whose body is its JSON arguments, ended by `<|call|>`. The
markers are special tokens of gpt-oss's tokenizer: the text is decoded with them kept. Both ways:
`HarmonyParser` reads an output as it arrives, `grammar` writes the messages a constrained answer
or a forced call must be. Torch-free.
"""
from __future__ import annotations

import re

from engine.tool_formats import Markers, ToolFormat, args_json, partial_suffix
from engine.tools import Tool, ToolCall

CHANNEL, MESSAGE, START, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (CHANNEL, MESSAGE, START, CONSTRAIN, END, CALL, RETURN)
_BODY_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_-]+)")


class HarmonyParser:
    """(reasoning, content, calls) of an output as its text arrives: analysis bodies stream as
    reasoning, final (and plain commentary) bodies as content, a call's body is held until its end.
    Text outside any message is content."""

    def __init__(self) -> None:
        self._held = ""
        self._header: str | None = ""  # the header being read; None inside a body
        self._channel = ""
        self._recipient: str | None = None
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._held:
            if self._header is not None:
                at = self._held.find(MESSAGE)
                if at < 0:
                    if not self._may_be_header(self._header + self._held):
                        content.append(self._header + self._held)  # not harmony: plain text
                        self._header, self._held = "", ""
                    break
                self._open(self._header + self._held[:at])
                self._held = self._held[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in _BODY_ENDS if (i := self._held.find(m)) >= 0]
            if not ends:
                keep = max(partial_suffix(self._held, m) for m in _BODY_ENDS)
                if self._recipient is None:
                    self._stream(self._held[:len(self._held) - keep], reasoning, content)
                    self._held = self._held[len(self._held) - keep:]
                break
            at, marker = min(ends)
            body, self._held = self._held[:at], self._held[at + (0 if marker == START else len(marker)):]
            self._close(body, reasoning, content, calls)  # the next header starts what is held
        return "".join(reasoning), "".join(content), calls

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """What is held: a body cut short is closed as it is (a call's arguments as they are)."""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._header is None:
            self._close(self._held, reasoning, content, calls)
        elif (self._header + self._held).strip():
            content.append(self._header + self._held)
        self._held, self._header = "", ""
        return "".join(reasoning), "".join(content), calls

    @staticmethod
    def _may_be_header(text: str) -> bool:
        """Text before <|message|> that a header ([<|start|>assistant] then the channel and the
        recipient, in either order) may still become."""
        if START.startswith(text):
            return True
        text = text.removeprefix(START)
        if "assistant".startswith(text):
            return True
        text = text.removeprefix("assistant").lstrip()
        return text.startswith((CHANNEL, "to=")) or any(m.startswith(text) for m in (CHANNEL, "to="))

    def _open(self, header: str) -> None:
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self._channel = channel.split()[0] if channel.split() else ""
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else None
        self._header = None

    def _stream(self, body: str, reasoning: list[str], content: list[str]) -> None:
        (reasoning if self._channel == "analysis" else content).append(body)

    def _close(self, body: str, reasoning: list[str], content: list[str], calls: list[ToolCall]) -> None:
        if self._recipient is not None:
            calls.append(ToolCall.new(self._recipient, body.strip()))
            self.num_calls += 1
        else:
            self._stream(body, reasoning, content)
        self._header, self._recipient, self._channel = "", None, ""


class Harmony(ToolFormat):
    name = "harmony"
    markers = MARKERS

    def calls_grammar(self, tools: list[Tool], parallel: bool, markers: Markers) -> str:
        """One call (a harmony call ends the output: `<|call|>` is a stop token)."""
        m = markers.lark
        calls = " | ".join(f'"commentary to=functions.{t.name} " {m(CONSTRAIN)} "json" {m(MESSAGE)} {args_json(t)}'
                           for t in tools)
        return f"start: {m(CHANNEL)} ({calls}) {m(CALL)}"

    def parser(self):
        raise TypeError("harmony outputs are read whole by HarmonyParser")


def analysis_prefix(markers: Markers) -> str:
    """Lark rules for an optional analysis message before the answer (`start: prefix answer`)."""
    m = markers.lark
    return (f'prefix: ({m(CHANNEL)} "analysis" {m(MESSAGE)} ANALYSIS {m(END)} {m(START)} "assistant")?\n'
            f"ANALYSIS: /(?s:[^<]|<[^|])*/")


def final_answer(markers: Markers) -> str:
    """The header of the final message an answer constraint goes in."""
    return f'{markers.lark(CHANNEL)} "final" {markers.lark(MESSAGE)}'
