"""Tool calls: the Hermes parser on whole and streamed outputs, the tools, calls and results
through the chat template (one that knows tools and one that does not), the choices' rules, and
forced calls through the engine's real path (LLM.chat): a `required` or named choice gives calls
to the allowed functions whose arguments validate, sampled with n > 1 and under speculation. The
other families' formats: test_chat_formats.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.chat_output import ChatOutputFormat
from engine.errors import InvalidRequestError
from engine.tokenization import encode_chat
from engine.tool_formats import Hermes
from engine.tools import Tool, conversation, parse_tools, resolve_tool_choice
from tests.conftest import build_tokenizer, save_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "the cat sat on a mat"}]
OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def parse_tool_calls(text: str):
    """A whole Hermes output's content (None if nothing but calls) and its calls."""
    parsed = ChatOutputFormat(None, "hermes").parse("", text, calls=True)
    return ((parsed.content.strip() or None) if parsed.calls else parsed.content), parsed.calls


def test_a_whole_output_splits_into_content_and_calls():
    content, calls = parse_tool_calls(OUTPUT)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')[0] is None
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls('<tool_call>\n{"name": "add", "argu') == ('<tool_call>\n{"name": "add", "argu', [])


@pytest.mark.parametrize("text", [OUTPUT, "a <tool and <b> then <tool_call", "x" + OUTPUT + "after"])
def test_the_streamed_parse_equals_the_whole_one_at_every_split(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        parser, content, calls = Hermes().parser(), "", []
        for piece in pieces:
            c, new = parser.feed(piece)
            content, calls = content + c, calls + new
        content += parser.finish()
        assert _calls(calls) == _calls(whole_calls)
        assert (content.strip() or None if calls else content) == whole_content


def test_tool_text_is_held_only_while_it_may_be_a_call():
    parser = Hermes().parser()
    assert parser.feed("see <tool") == ("see ", [])
    assert parser.feed("s below") == ("<tools below", [])
    assert parser.feed("<tool_call>\n{") == ("", [])
    content, calls = parser.feed('"name": "add", "arguments": {}}\n</tool_call>\n')
    assert content == "" and _calls(calls) == [("add", {})]
    assert parser.feed("\n") == ("", []) and parser.finish() == ""


def test_a_template_without_tools_gets_them_as_text_with_calls_and_results():
    tokenizer = build_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *CHAT,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
                {"role": "tool", "tool_call_id": "c2", "content": "3"}]
    text = tokenizer.decode(encode_chat(tokenizer, messages, tools=parse_tools(TOOLS)))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[1]) in text and '"description": "Weather in a city"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 1, "b": 2}}\n</tool_call><|im_end|>') in text
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n3\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    no_system = conversation(CHAT, parse_tools(TOOLS), native=False)
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")
    assert no_system[1:] == CHAT
    assert conversation(CHAT, [], native=False) == CHAT


def test_a_template_that_reads_tools_renders_them_itself():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} | {% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %} CALL {{ c.function.name }} {{ c.function.arguments.city }}"
        "{% endfor %}{% if m.get('tool_call_id') %} FOR {{ m['tool_call_id'] }}{% endif %} | {% endfor %}")
    messages = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    text = tokenizer.decode(encode_chat(tokenizer, messages, add_generation_prompt=False, tools=parse_tools(TOOLS)))
    assert text == ("TOOLS get_weather,add | user: the cat sat on a mat | assistant:  CALL get_weather Oslo | "
                    "tool: cold FOR c1 | ")


@pytest.mark.parametrize("tools,choice,param,message", [
    ([{"type": "function"}], None, "tools", "a tool must be"),
    ([{"type": "function", "function": {"name": "no spaces"}}], None, "tools", "must match"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}], None, "tools",
     "the parameters of f"),
    (TOOLS + TOOLS[:1], None, "tools", "unique"),
    (TOOLS, "sometimes", "tool_choice", "tool_choice must be one of"),
    ([], "required", "tool_choice", "needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "mul"}}, "tool_choice", "not in tools"),
    (TOOLS, {"type": "function"}, "tool_choice", "a named tool_choice"),
])
def test_bad_tools_and_choices_are_refused_naming_the_field(tools, choice, param, message):
    with pytest.raises(InvalidRequestError, match=message) as raised:
        resolve_tool_choice(choice, parse_tools(tools))
    assert raised.value.param == param


def test_the_default_choice_is_auto_with_tools_and_none_without():
    assert resolve_tool_choice(None, parse_tools(TOOLS)) == "auto"
    assert resolve_tool_choice(None, []) == "none"
    assert Tool.parse({"type": "function", "function": {"name": "f"}}).parameters == {"type": "object",
                                                                                      "properties": {}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    """A tiny Llama with room for the tools' system prompt (~750 tokens in its small vocabulary)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-tools"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def llm(tools_model) -> LLM:
    return LLM(tools_model, max_num_seqs=16)


def _valid_calls(text: str, allowed: set[str]) -> list[tuple[str, dict]]:
    content, calls = parse_tool_calls(text)
    assert content is None and calls, text
    for name, arguments in _calls(calls):
        assert name in allowed
        jsonschema.validate(arguments, SCHEMAS[name])
    return _calls(calls)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_choice_gives_calls_whose_arguments_validate(llm, choice):
    allowed = {"add"} if isinstance(choice, dict) else set(SCHEMAS)
    params = SamplingParams(max_tokens=200, temperature=1.0, n=4, seed=3)
    [single] = llm.chat(CHAT, params, use_tqdm=False, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    for c in single.outputs:
        assert c.finish_reason == "stop" and len(_valid_calls(c.text, allowed)) == 1
    [greedy] = llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=0), use_tqdm=False, tools=TOOLS,
                        tool_choice=choice)
    assert greedy.outputs[0].finish_reason in ("stop", "length")
    complete = greedy.outputs[0].text.rsplit("</tool_call>", 1)[0] + "</tool_call>"
    assert _valid_calls(complete, allowed)


def test_required_calls_may_name_every_tool(llm):
    [output] = llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=1.0, n=8, seed=11), use_tqdm=False,
                        tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert {_valid_calls(c.text, set(SCHEMAS))[0][0] for c in output.outputs} == set(SCHEMAS)


def test_forced_calls_under_speculation_equal_those_without(llm, tools_model):
    params = SamplingParams(max_tokens=120, temperature=0)
    expected = llm.chat(CHAT, params, use_tqdm=False, tools=TOOLS, tool_choice="required")[0].outputs[0].token_ids
    speculative = LLM(tools_model, speculative_config={"method": "self_draft", "num_layers": 1,
                                                       "num_speculative_tokens": 3, "adaptive": False})
    [out] = speculative.chat(CHAT, params, use_tqdm=False, tools=TOOLS, tool_choice="required")
    assert out.outputs[0].token_ids == expected
    assert speculative.engine.get_stats().num_spec_proposed_tokens > 0


def test_a_forced_choice_and_a_structured_output_together_are_refused(llm):
    from engine.sampling_params import StructuredOutputsParams

    with pytest.raises(InvalidRequestError, match="cannot be given with a structured output"):
        llm.chat(CHAT, SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False,
                 tools=TOOLS, tool_choice="required")
    assert not llm.engine.has_unfinished_requests()
