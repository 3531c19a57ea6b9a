"""The embedded SmolLM2 behind the app, through the official openai client, in its default mode:
a json_schema response validates, and named and required tool calls carry arguments that
validate against their parameters, streamed and not (its real 49k-token vocabulary under the
grammar engine; its template has no tools section, so they come in as the Hermes system text)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import served_real_engine

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client():
    with served_real_engine(None, 2048, name="smol") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none")


def test_a_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    out = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Describe Paris."}],
                                         max_tokens=64, temperature=0.7, n=2, seed=1, response_format={
                                             "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_named_and_required_calls_validate_against_their_parameters(client):
    named = client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0.7, n=2, seed=2,
                                           tools=TOOLS, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    required = client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0,
                                              tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert [c.finish_reason for c in named.choices + required.choices] == ["stop", "stop", "tool_calls"]
    for choice in named.choices + required.choices:
        [call] = choice.message.tool_calls
        assert call.function.name in ({"get_weather"} if choice in named.choices else set(SCHEMAS))
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False, stream=True)
    calls = [call for chunk in stream for c in chunk.choices for call in c.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
