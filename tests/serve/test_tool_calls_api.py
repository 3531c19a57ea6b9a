"""Tool calls over HTTP through the official openai client, against the app on the real engine
(tiny random Llama, byte-level BPE): named and required choices give calls whose arguments
validate, streamed and not, with n > 1; `auto` parses the calls the model writes (here forced by
a choice constraint) into `tool_calls` with finish_reason `tool_calls`; `none` leaves the text
alone; a conversation with calls and tool results goes through the template; forced calls take
what pydantic writes for nested and recursive models, and one cut short shows no markup."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import served_real_engine

from tests.conftest import save_tiny_model
from tests.engine.test_tools import SCHEMAS, TOOLS

MESSAGES = [{"role": "user", "content": "the cat sat on a mat"}]
WRITTEN = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
           '</tool_call>')


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tiny-tools"), "llama", max_position_embeddings=2048)
    with served_real_engine(model, 2048) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def _check(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(stream) -> dict[int, dict]:
    """Each choice's content, calls (accumulated as OpenAI's stream helpers do) and finish_reason."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            choice["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                got = choice["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                got["id"] = call.id or got["id"]
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
            choice["finish_reason"] = c.finish_reason or choice["finish_reason"]
    return choices


def test_a_named_choice_calls_that_function_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, n=2,
                                         seed=5, tools=TOOLS, tool_choice=named)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check(call.function.name, call.function.arguments, {"add"})
    streamed = _streamed(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, n=2,
                                                        temperature=1.0, seed=5, tools=TOOLS, tool_choice=named,
                                                        stream=True))
    assert set(streamed) == {0, 1}
    for choice in streamed.values():
        assert choice["finish_reason"] == "stop" and choice["content"] == "" and len(choice["calls"]) == 1
        _check(choice["calls"][0]["name"], choice["calls"][0]["arguments"], {"add"})


def test_a_required_choice_calls_one_of_the_tools(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, n=3,
                                         seed=9, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments,
               set(SCHEMAS))
    streamed = _streamed(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                        temperature=0, tools=TOOLS, tool_choice="required",
                                                        parallel_tool_calls=False, stream=True))
    assert streamed[0]["finish_reason"] == "tool_calls" and len(streamed[0]["calls"]) == 1
    _check(streamed[0]["calls"][0]["name"], streamed[0]["calls"][0]["arguments"], set(SCHEMAS))


def test_auto_parses_the_calls_the_model_writes(client):
    forced = {"structured_outputs": {"choice": [WRITTEN]}}  # the tiny model writes what a tuned one would
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, tools=TOOLS,
                                         tool_choice="auto", extra_body=forced)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "unit": "c"})
    streamed = _streamed(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                        temperature=0, tools=TOOLS, extra_body=forced, stream=True))
    assert streamed[0]["content"] == "Let me check.\n" and streamed[0]["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed[0]["calls"].values()] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    untouched = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                                               tools=TOOLS, tool_choice="none", extra_body=forced)
    assert untouched.choices[0].message.content == WRITTEN and not untouched.choices[0].message.tool_calls
    assert untouched.choices[0].finish_reason == "stop"


def test_a_tool_result_round_trips_through_the_template(client, url):
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    tokens = httpx.post(url + "/tokenize", json={"messages": conversation, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    out = client.chat.completions.create(model="tiny", messages=conversation, max_tokens=200, temperature=0,
                                         tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert out.usage.prompt_tokens == len(tokens)
    _check(out.choices[0].message.tool_calls[0].function.name, out.choices[0].message.tool_calls[0].function.arguments,
           set(SCHEMAS))


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    zone: Literal["north", "south"]


class Node(pydantic.BaseModel):  # recursive: refers to itself by "#/$defs/Node"
    value: int = pydantic.Field(ge=0, le=9)
    kids: list[Node] = pydantic.Field(max_length=1)


class Visit(pydantic.BaseModel):
    """What pydantic emits for nested models: local $defs and $refs, anyOf for an optional field."""
    home: Address
    stops: list[Address] = pydantic.Field(max_length=2)
    plan: Node | None = None


def test_forced_calls_take_the_schemas_pydantic_writes_for_nested_and_recursive_models(client):
    tool = openai.pydantic_function_tool(Visit)
    assert "$defs" in json.dumps(tool["function"]["parameters"])
    for choice in ("required", {"type": "function", "function": {"name": "Visit"}}):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, temperature=1.0, n=2,
                                             seed=3, tools=[tool], tool_choice=choice)
        for c in out.choices:
            [call] = c.message.tool_calls
            Visit.model_validate_json(call.function.arguments)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_forced_call_cut_short_comes_back_without_its_markup(client):
    for stream in (False, True):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                             tools=TOOLS, tool_choice="required", stream=stream)
        if stream:
            [choice] = _streamed(out).values()
            content, finish = choice["content"], choice["finish_reason"]
        else:
            content, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert finish == "length" and not content  # no "<tool_call>" as text
