"""Structured outputs over HTTP through the official openai client, against the app on the real
engine (tiny random Llama with a byte-level BPE tokenizer, its step loop in a child process):
response_format json_schema and json_object on chat and completions, streamed and not, with
n > 1; vLLM's structured_outputs and guided_* fields; a constraint the grammar engine cannot
compile is a 400 and the server goes on."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import served_real_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "level": {"enum": ["low", "mid", "high"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "level", "scores", "owner"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "the cat sat on a mat"}]


@pytest.fixture(scope="module")
def client(tiny_llama):
    with served_real_engine(tiny_llama, 256) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none")


def _valid(text: str) -> bool:
    return jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(text))


def test_a_json_schema_response_format_validates_streamed_or_not_with_n(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, n=3,
                                           seed=3, response_format=fmt)
    assert len(whole.choices) == 3
    for choice in whole.choices:
        assert choice.finish_reason == "stop" and _valid(choice.message.content), choice.message.content
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, n=2,
                                            seed=3, response_format=fmt, stream=True)
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert set(texts) == {0, 1} and all(_valid(t) for t in texts.values()) and set(reasons.values()) == {"stop"}


def test_completions_take_response_format_and_vllm_structured_outputs(client):
    obj = client.completions.create(model="tiny", prompt="the cat", max_tokens=120, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "r", "schema": SCHEMA}}})
    assert _valid(obj.choices[0].text)
    choice = client.completions.create(model="tiny", prompt="the cat", max_tokens=20, temperature=1.0, n=4,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c.text for c in choice.choices} <= {"red", "green", "blue"}
    regex = client.completions.create(model="tiny", prompt="the cat", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"[a-z]{3}-[0-9]{3}"})
    assert re.fullmatch(r"[a-z]{3}-[0-9]{3}", regex.choices[0].text)
    grammar = client.completions.create(model="tiny", prompt="the cat", max_tokens=30, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= "sum(" [0-9] ("," [0-9])* ")"'})
    assert re.fullmatch(r"sum\([0-9](,[0-9])*\)", grammar.choices[0].text)
    guided = client.completions.create(model="tiny", prompt="the cat", max_tokens=120, temperature=0,
                                       extra_body={"guided_json": json.dumps(SCHEMA)})
    assert _valid(guided.choices[0].text)


def test_a_json_object_response_format_gives_an_object(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


def test_a_constraint_that_does_not_compile_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="look-around"):
        client.completions.create(model="tiny", prompt="the cat", max_tokens=5, extra_body={"guided_regex": "(?=a)b"})
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object", "required": "a"}}})
    ok = client.completions.create(model="tiny", prompt="the cat", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_llama_cpps_grammar_and_json_schema_fields_constrain_the_output(client):
    picked = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=1.0, seed=2,
                                       extra_body={"grammar": 'root ::= "cat" | "dog"'})
    assert picked.choices[0].text in ("cat", "dog")
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=40, temperature=1.0, seed=2, extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError, match="give one output constraint"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  extra_body={"grammar": 'root ::= "a"', "json_schema": schema})
