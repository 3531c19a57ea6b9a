"""Reasoning output in think tags: the thinking section a reasoning model writes before its answer,
`<think>` ... `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills; gpt-oss's analysis channel is
engine/harmony.py's), read apart from the answer as its text arrives, and the constraint that lets
the thinking run free and constrains only what follows it.

Where the answer starts depends on the prompt: a template may open the section in its generation
prompt (DeepSeek-R1's ends with `<think>\\n`), close an empty one to turn thinking off (Qwen3's
`enable_thinking=False`), or leave it to the model to open (Qwen3's default). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.tool_formats import Markers, partial_suffix

START, END = "<think>", "</think>"
# the answer's leading newlines (the templates write "</think>\n\n" before it) are not part of it
_GAP = "\n"


def section_in(prompt_text: str) -> str:
    """Where the prompt leaves the output: "open" inside a thinking section, "closed" right after
    one (thinking turned off: no section follows), or "none" (the model may open one)."""
    start, end = prompt_text.rfind(START), prompt_text.rfind(END)
    if start > end:
        return "open"
    if end >= 0 and not prompt_text[end + len(END):].strip():
        return "closed"
    return "none"


@dataclass(slots=True)
class ThinkSplitter:
    """Splits an output into reasoning and answer as its text arrives; `section`: where the
    prompt leaves it (section_in). Text that may still turn out to be a tag is held until it is
    known; the tags and the newlines that start the answer are dropped."""
    section: str = "none"
    _state: str = ""  # "before" the section may open, "in" it, "gap" after it, "answer"
    _held: str = ""

    def __post_init__(self) -> None:
        self._state = {"open": "in", "closed": "answer", "none": "before"}[self.section]

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) text that can be returned now."""
        self._held += text
        reasoning = answer = ""
        while True:
            held = self._held
            if self._state == "before":
                lead = held.lstrip()
                if lead.startswith(START):
                    self._state, self._held = "in", lead[len(START):]
                    continue
                if START.startswith(lead):  # empty, or the start of the tag: wait
                    break
                self._state = "answer"
                continue
            if self._state == "in":
                end = held.find(END)
                if end >= 0:
                    reasoning += held[:end]
                    self._state, self._held = "gap", held[end + len(END):]
                    continue
                keep = partial_suffix(held, END)
                reasoning, self._held = reasoning + held[:len(held) - keep], held[len(held) - keep:]
                break
            if self._state == "gap":
                self._held = held.lstrip(_GAP)
                if not self._held:
                    break
                self._state = "answer"
                continue
            answer, self._held = answer + held, ""
            break
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held: an unclosed section's end is reasoning; text that never opened one is answer."""
        held, self._held = self._held, ""
        if self._state == "in":
            return held, ""
        return "", held if self._state in ("before", "answer") else ""


def think_prefix(section: str, markers: Markers) -> str | None:
    """Lark rules for what comes before the answer (`start: prefix answer`): the rest of an open
    section up to its end tag, or, where the model may open one, an optional whole section; then
    the newlines before the answer. None after a closed section: the answer comes at once. The section is free text that
    does not end early; a tag the tokenizer holds as a token is written as it
    (engine.tool_formats.Markers)."""
    end = END.replace("/", "\\/")
    text = f"THINK: /(?s:.*)/ & ~/(?s:.*{end}.*)/"
    section_rule = f"THINK {markers.lark(END)}"
    if END not in markers.tokens:  # the end tag is text: the section's text ends with it, once
        text, section_rule = f"THINK: /(?s:.*{end})/ & ~/(?s:.*{end}.+)/", "THINK"
    if section == "closed":
        return None
    if section == "open":
        return f"prefix: {section_rule} GAP\n{text}\nGAP: /\\n*/"
    return f"prefix: (/[ \\n]*/ {markers.lark(START)} {section_rule} GAP)?\n{text}\nGAP: /\\n*/"
