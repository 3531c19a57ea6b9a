"""Each family's chat output format, on tokenizers holding that family's tokens and its real chat
template (tests/data/chat_templates): the format chosen from the template (and by the engine
arguments), every parser on whole outputs and on the same outputs streamed at every split, and the
grammars of forced calls and of answers after reasoning accepting what the family writes and
refusing what breaks the constraint. Through the engine's real path (LLM.chat) on tiny random
models: forced calls in each family's own format parse into calls whose arguments validate, and a
structured answer after free reasoning."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.chat_output import ChatDelta, ChatOutputFormat
from engine.errors import RequestFailedError
from engine.grammar import GrammarCompiler, RequestGrammar
from engine.sampling_params import StructuredOutputsParams
from engine.tokenization import render_chat
from engine.tools import forced_tools, parse_tools
from tests.conftest import CHAT_FAMILIES, build_chat_tokenizer, build_tokenizer, save_tiny_chat_model
from tests.engine.test_tools import ADD, SCHEMAS, TOOLS

# the tools with descriptions: gpt-oss's template writes each one's
DESCRIBED = [{"type": "function", "function": {"description": "Does it."} | t["function"]} for t in TOOLS]
FORMATS = {"qwen3": ("think", "hermes"), "llama3": (None, "llama3_json"), "mistral": (None, "mistral"),
           "gpt_oss": ("harmony", "harmony"), "deepseek_r1": ("think", "hermes")}
ADD_CALL = {"name": "add", "arguments": {"a": 1, "b": 2}}
# family -> (the end of its prompt, an output, what it parses into: reasoning, content, calls (name, arguments))
OUTPUTS = {
    "qwen3": ("<|im_start|>assistant\n",
              '<think>\nAdd them.\n</think>\n\nOne call:\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
              '</tool_call>',
              ("\nAdd them.\n", "One call:", [("add", {"a": 1, "b": 2}),
                                             ("get_weather", {"city": "Oslo", "unit": "c"})])),
    "deepseek_r1": ("<｜Assistant｜><think>\n", "It is 2.</think>\n\nThe answer is 2.",
                    ("It is 2.", "The answer is 2.", [])),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n",
               '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
               '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
               ("", None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})])),
    "mistral": ("[/INST]", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                ("", None, [("add", {"a": 1, "b": 2})])),
    "gpt_oss": ("<|start|>assistant",
                "<|channel|>analysis<|message|>Need the sum.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}',
                ("Need the sum.", None, [("add", {"a": 1, "b": 2})])),
}
PLAIN = {  # outputs with no calls, read as content (and reasoning)
    "qwen3": ("", "<thin and </think> are text here", ("", "<thin and </think> are text here", [])),
    "llama3": ("", "Hello {there}", ("", "Hello {there}", [])),
    "mistral": ("", "No [TOOL_CALL here", ("", "No [TOOL_CALL here", [])),
    "gpt_oss": ("", "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
                ("Hmm.", "Hi!", [])),
}


def _format(family: str) -> ChatOutputFormat:
    return ChatOutputFormat.of(build_chat_tokenizer(family))


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _answer(delta: ChatDelta) -> tuple[str, str | None, list]:
    content = (delta.content.strip() or None) if delta.calls else delta.content
    return delta.reasoning, content, _calls(delta.calls)


def test_each_template_gets_its_familys_format_and_the_engine_arguments_override_it():
    for family, expected in FORMATS.items():
        fmt = _format(family)
        assert (fmt.reasoning, fmt.tools) == expected, family
    plain = ChatOutputFormat.of(build_tokenizer())
    assert (plain.reasoning, plain.tools) == (None, "hermes")
    forced = ChatOutputFormat.of(build_chat_tokenizer("qwen3"), reasoning_parser="none", tool_call_parser="mistral")
    assert (forced.reasoning, forced.tools) == (None, "mistral")
    gpt = _format("gpt_oss")
    assert gpt.keeps_special_tokens(calls=False) and not _format("llama3").keeps_special_tokens(calls=False)
    assert _format("llama3").keeps_special_tokens(calls=True) and not _format("qwen3").keeps_special_tokens(True)


@pytest.mark.parametrize("family,case", [(f, c) for f in OUTPUTS for c in ("calls", "plain")
                                         if c == "calls" or f in PLAIN])
def test_a_streamed_output_parses_as_the_whole_one_at_every_split(family, case):
    prompt, text, expected = (OUTPUTS if case == "calls" else PLAIN)[family]
    fmt = _format(family)
    assert _answer(fmt.parse(prompt, text, calls=True)) == expected
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        parser, whole = fmt.parser(prompt, calls=True), ChatDelta()
        for piece in pieces:
            whole += parser.feed(piece)
        whole += parser.finish()
        assert _answer(whole) == expected, pieces


def test_without_calls_asked_for_call_text_is_content():
    fmt = _format("qwen3")
    text = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    assert fmt.parse("", text, calls=False) == ChatDelta("", text, [])
    unclosed = fmt.parse("<think>\n", "still thinking", calls=True)
    assert (unclosed.reasoning, unclosed.content) == ("still thinking", "")


def _grammar(family: str, spec: StructuredOutputsParams) -> tuple[RequestGrammar, object]:
    tokenizer = build_chat_tokenizer(family)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    return RequestGrammar(compiler.compile(spec).result()), tokenizer


def _accepts(family: str, spec: StructuredOutputsParams, text: str) -> bool:
    grammar, tokenizer = _grammar(family, spec)
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            grammar.accept(token)
    except RequestFailedError:
        return False
    return grammar.is_finished


CANONICAL = {  # family -> a forced call to add as it writes one (after the prompt of OUTPUTS)
    "qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "gpt_oss": '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>',
}


@pytest.mark.parametrize("family", list(CANONICAL))
def test_the_forced_call_grammar_takes_the_familys_calls_and_refuses_bad_arguments(family):
    fmt = _format(family)
    prompt = OUTPUTS[family][0]
    spec = fmt.constraint(prompt, forced=forced_tools(parse_tools(TOOLS), "add"))
    call = CANONICAL[family]
    assert _accepts(family, spec, call)
    assert not _accepts(family, spec, call.replace('"a": 1', '"a": 100'))  # ADD's maximum is 99
    assert not _accepts(family, spec, call.replace("add", "get_weather", 1))
    if family == "qwen3":
        assert _accepts(family, spec, "<think>\nFree text, <b>tags</b> too.\n</think>\n\n" + call)
    if family == "gpt_oss":
        assert _accepts(family, spec, "<|channel|>analysis<|message|>Sum them.<|end|><|start|>assistant" + call)


@pytest.mark.parametrize("family,prompt,before", [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nIt is 3.\n</think>\n\n"),
    ("qwen3", "<|im_start|>assistant\n", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "The sum </thin is 3.\n</think>\n\n"),
    ("gpt_oss", "<|start|>assistant", "<|channel|>analysis<|message|>Sum.<|end|><|start|>assistant"
                                      "<|channel|>final<|message|>"),
])
def test_a_structured_answer_is_constrained_after_free_reasoning(family, prompt, before):
    spec = _format(family).constraint(prompt, answer=StructuredOutputsParams(json=ADD))
    assert _accepts(family, spec, before + '{"a": 1, "b": 2}')
    assert not _accepts(family, spec, before + '{"a": "one", "b": 2}')
    choice = _format(family).constraint(prompt, answer=StructuredOutputsParams(choice=["yes", "no"]))
    assert _accepts(family, choice, before + "no") and not _accepts(family, choice, before + "maybe")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    return {f: save_tiny_chat_model(tmp_path_factory.mktemp(f"chat-{f}"), f) for f in CHAT_FAMILIES}


CHAT = [{"role": "user", "content": "the cat sat on a mat"}]


@pytest.mark.parametrize("family", ["qwen3", "llama3", "mistral", "gpt_oss"])
def test_forced_calls_come_in_the_familys_format_and_parse_into_valid_calls(family_models, family):
    llm = LLM(family_models[family], quantization="none", max_num_seqs=4)
    kwargs = {"enable_thinking": False} if family == "qwen3" else None
    outputs = llm.chat(CHAT, SamplingParams(max_tokens=120, temperature=1.0, n=3, seed=5), use_tqdm=False,
                       tools=DESCRIBED, tool_choice="required", parallel_tool_calls=False,
                       chat_template_kwargs=kwargs)
    prompt = render_chat(llm.tokenizer, CHAT, True, parse_tools(DESCRIBED), kwargs)
    for sample in outputs[0].outputs:
        assert sample.finish_reason == "stop", sample.text
        parsed = llm.chat_format.parse(prompt, sample.text, calls=True)
        [(name, arguments)] = _calls(parsed.calls)
        jsonschema.validate(arguments, SCHEMAS[name])
        assert not parsed.content.strip()


def test_a_structured_answer_follows_the_reasoning_the_model_writes(family_models):
    llm = LLM(family_models["qwen3"], quantization="none", max_num_seqs=4)
    tok = llm.tokenizer
    bias = {tok.convert_tokens_to_ids("<think>"): 8.0, tok.convert_tokens_to_ids("</think>"): 6.0,
            tok.encode("cat", add_special_tokens=False)[0]: 7.0}
    params = SamplingParams(max_tokens=200, temperature=0, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(json=ADD))
    [out] = llm.chat(CHAT, params, use_tqdm=False)
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and text.startswith("<think>"), text
    parsed = llm.chat_format.parse(render_chat(tok, CHAT), text, calls=False)
    reasoning, answer = text.removeprefix("<think>").split("</think>", 1)
    assert (parsed.reasoning, parsed.content) == (reasoning, answer.lstrip("\n"))
    jsonschema.validate(json.loads(parsed.content), ADD)
