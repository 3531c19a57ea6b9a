"""A chat turn's output as the model writes it: reasoning, the answer, tool calls. One
`ChatOutputFormat` per model, chosen from its chat template (or the engine's `reasoning_parser` and
`tool_call_parser` arguments): which reasoning convention (think tags, engine/reasoning.py; gpt-oss's
channels, engine/harmony.py; none) and which call format (engine/tool_formats.py). It gives each
request

- its parser: the output split, whole or as it streams, into reasoning, content and calls;
- its constraint: a structured output or a forced call constrains the answer only, the reasoning
  before it left free (as vLLM applies structured outputs after the reasoning ends), written as
  one grammar so the engine needs no notion of reasoning.

Torch-free: the serve app's ingress uses it as the offline API does.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.harmony import MARKERS as HARMONY_MARKERS
from engine.harmony import Harmony, HarmonyParser, analysis_prefix, final_answer
from engine.reasoning import END, START, ThinkSplitter, section_in, think_prefix
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tool_formats import JSON_STYLE, TOOL_FORMATS, CallParser, Markers, ToolFormat, tool_format_for
from engine.tools import Tool, ToolCall


def reasoning_parser_for(chat_template: str | None) -> str | None:
    """The reasoning convention a chat template renders, if any."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if END in template:
        return "think"
    return None


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, later: ChatDelta) -> ChatDelta:
        return ChatDelta(self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls)


class ChatOutputParser:
    """One output's parts as its text arrives (`feed`), and what was held at its end (`finish`)."""

    def __init__(self, fmt: ChatOutputFormat, section: str, calls: bool, forced: bool = False) -> None:
        """`section`: where the prompt leaves a thinking section (engine.reasoning.section_in);
        `forced`: the answer is calls alone (a required or named choice), so what an output cut
        short leaves of an unfinished call is dropped, not made content."""
        self._harmony = HarmonyParser() if fmt.reasoning == "harmony" or fmt.tools == "harmony" else None
        self._think = ThinkSplitter(section) if fmt.reasoning == "think" else None
        self._calls: CallParser | None = TOOL_FORMATS[fmt.tools].parser() if calls and self._harmony is None \
            else None
        self._take_calls, self._forced = calls, forced
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        return self._parts(*self._split(text), finished=False)

    def finish(self) -> ChatDelta:
        return self._parts(*self._split(None), finished=True)

    def _split(self, text: str | None) -> tuple[str, str, list[ToolCall]]:
        if self._harmony is not None:
            return self._harmony.feed(text) if text is not None else self._harmony.finish()
        if self._think is not None:
            return (*(self._think.feed(text) if text is not None else self._think.finish()), [])
        return "", text or "", []

    def _parts(self, thought: str, answer: str, calls: list[ToolCall], finished: bool) -> ChatDelta:
        if not self._take_calls and calls:  # calls not asked for: their text is content
            answer += "".join(c.arguments for c in calls)
            calls = []
        if self._calls is not None:
            answer, calls = self._calls.feed(answer)
            if finished:
                rest = self._calls.finish()
                answer += "" if self._forced else rest
        self.num_calls += len(calls)
        return ChatDelta(thought, answer, calls)


@dataclass(frozen=True)
class ChatOutputFormat:
    reasoning: str | None  # "think", "harmony" or None
    tools: str  # "hermes", "llama3_json", "mistral" or "harmony"
    markers: Markers = Markers()

    @classmethod
    def of(cls, tokenizer, reasoning_parser: str = "auto", tool_call_parser: str = "auto") -> ChatOutputFormat:
        """The format of `tokenizer`'s chat template, each part as the engine arguments of the
        same names give it where not "auto" (engine.config.REASONING_PARSERS, TOOL_CALL_PARSERS)."""
        template = getattr(tokenizer, "chat_template", None)
        chosen_reasoning = reasoning_parser_for(template) if reasoning_parser == "auto" else reasoning_parser
        chosen_tools = tool_format_for(template) if tool_call_parser == "auto" else tool_call_parser
        wanted = {*HARMONY_MARKERS, START, END,
                  *(marker for f in TOOL_FORMATS.values() for marker in f.markers)}
        added = {t.content: (i, t.special) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                 if t.content in wanted}
        markers = Markers({text: i for text, (i, _) in added.items()},
                          frozenset(text for text, (_, special) in added.items() if special))
        return cls(None if chosen_reasoning == "none" else chosen_reasoning, chosen_tools, markers)

    @property
    def tool_format(self) -> ToolFormat:
        return Harmony() if self.tools == "harmony" else TOOL_FORMATS[self.tools]

    def keeps_special_tokens(self, calls: bool) -> bool:
        """The markers its parser reads (`calls`: the call format's too) are special tokens: the
        output is decoded with special tokens kept."""
        used = (self.tool_format.markers if calls else ()) + (HARMONY_MARKERS if self.reasoning == "harmony" else ())
        return self.markers.skipped(used)

    def parser(self, prompt_text: str, calls: bool, forced: bool = False) -> ChatOutputParser:
        """A parser for one output of `prompt_text`; `calls`: tool calls are read out of it;
        `forced`: they are all it holds (ChatOutputParser)."""
        return ChatOutputParser(self, section_in(prompt_text), calls, forced)

    def parse(self, prompt_text: str, text: str, calls: bool) -> ChatDelta:
        """A whole output's parts."""
        parser = self.parser(prompt_text, calls)
        return parser.feed(text) + parser.finish()

    def sampling_params(self, params: SamplingParams, prompt_text: str, forced: tuple[list[Tool], bool] | None,
                        calls: bool) -> SamplingParams:
        """`params` for one chat turn in this format: its structured output, or the `forced` calls
        (engine.tools.forced_tools), constraining the answer after any reasoning; special tokens
        kept in the text where the parser reads them (`calls`: tool calls are read)."""
        if forced is not None and params.structured_outputs is not None:
            raise InvalidRequestError("tool_choice", "a required or named tool_choice constrains the output; it "
                                                     "cannot be given with a structured output")
        return dataclasses.replace(params, structured_outputs=self.constraint(prompt_text, params.structured_outputs,
                                                                              forced),
                                   skip_special_tokens=params.skip_special_tokens
                                   and not self.keeps_special_tokens(calls))

    def constraint(self, prompt_text: str, answer: StructuredOutputsParams | None = None,
                   forced: tuple[list[Tool], bool] | None = None) -> StructuredOutputsParams | None:
        """The output's constraint: `answer` (a structured output) or `forced` calls (the allowed
        tools, and whether several calls may come), after whatever reasoning the model writes."""
        prefix = think_prefix(section_in(prompt_text), self.markers) \
            if self.reasoning == "think" else None
        if forced is not None:
            body = self.tool_format.calls_grammar(*forced, self.markers)
        elif answer is not None:
            if self.reasoning is None or (self.reasoning == "think" and prefix is None):
                return answer
            body = lark_of(answer)
        else:
            return None
        if self.reasoning == "harmony":
            head = "" if forced is not None else f"{final_answer(self.markers)} "
            return _grammar(f"start: prefix {head}body\n{analysis_prefix(self.markers)}", body)
        if prefix is not None:
            return _grammar(f"start: prefix body\n{prefix}", body)
        return StructuredOutputsParams(grammar=body)


def _grammar(rules: str, body: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=f"{rules}\nbody: %lark {{\n{body}\n}}\n")


def lark_of(spec: StructuredOutputsParams) -> str:
    """Any structured output as a Lark grammar (for nesting in a larger one), JSON written as the
    engine writes it (engine/grammar.py)."""
    if spec.regex is not None:
        return "start: /" + spec.regex.replace("/", "\\/") + "/"
    if spec.choice is not None:
        return "start: " + " | ".join(json.dumps(c) for c in spec.choice)
    if spec.grammar is not None:
        if "::=" in spec.grammar:  # GBNF
            import llguidance
            return llguidance.grammar_from("gbnf", spec.grammar)
        return spec.grammar
    schema = spec.json if spec.json is not None else {"type": "object"}  # a schema, or any JSON object
    schema = json.loads(schema) if isinstance(schema, str) else schema
    return f"start: %json {json.dumps(schema | {'x-guidance': JSON_STYLE})}"
