"""Anthropic's Messages API through the official anthropic client, against the app on the real
engine (a tiny random Qwen3 with Qwen3's chat template): a message's text is the chat
completion's for the same conversation; its stream comes as Anthropic's events, in order, and
accumulates (the client's own stream helper) into the same message; a forced tool_use and its
tool_result make a round trip; stop_sequences end a message with stop_reason stop_sequence;
count_tokens counts the prompt; bad blocks, unknown fields, a missing max_tokens and a bad key
are errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import served_real_engine

from tests.conftest import save_tiny_chat_model
from tests.engine.test_tools import SCHEMAS, TOOLS

QUESTION = [{"role": "user", "content": "the cat sat on a mat"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the current SDK leaves sampling fields to extra_body; the API takes them
TOOL_DEFS = [{"name": t["function"]["name"], "description": "Does it.", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("qwen3-messages"), "qwen3")
    with served_real_engine(model, 2048, ingress={"api_keys": ["sekret"]}) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="sekret")


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_is_the_chat_completion_of_its_conversation(client, url):
    message = client.messages.create(model="tiny", max_tokens=24, **GREEDY, system="Be brief.",
                                     messages=QUESTION, thinking={"type": "disabled"})
    chat = openai.OpenAI(base_url=url + "/v1", api_key="sekret").chat.completions.create(
        model="tiny", max_tokens=24, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION])
    assert _text(message) == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                         chat.usage.completion_tokens)
    assert message.role == "assistant" and message.model == "tiny" and message.id.startswith("msg_")
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=QUESTION,
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == message.usage.input_tokens


def test_the_stream_comes_as_anthropics_events_and_adds_up_to_the_message(client):
    kwargs = dict(model="tiny", max_tokens=24, **GREEDY, messages=QUESTION)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_use_and_its_result_make_a_round_trip(client):
    first = client.messages.create(model="tiny", max_tokens=300, **GREEDY, messages=QUESTION, tools=TOOL_DEFS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   thinking={"type": "disabled"})
    [use] = [block for block in first.content if block.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMAS[use.name])
    assert first.stop_reason == "tool_use" and use.id.startswith("toolu_")
    with client.messages.stream(model="tiny", max_tokens=300, **GREEDY, messages=QUESTION, tools=TOOL_DEFS,
                                tool_choice={"type": "tool", "name": use.name},
                                thinking={"type": "disabled"}) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    second = client.messages.create(model="tiny", max_tokens=8, **GREEDY, tools=TOOL_DEFS, messages=[
        *QUESTION, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(3)}]}])
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 5


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    free = client.messages.create(model="tiny", max_tokens=24, **GREEDY, messages=QUESTION)
    word = _text(free)[4:8]
    assert word.strip()
    stopped = client.messages.create(model="tiny", max_tokens=24, **GREEDY, messages=QUESTION,
                                     stop_sequences=[word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert _text(stopped) == _text(free)[:_text(free).index(word)]


@pytest.mark.parametrize("body,status,kind,says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "image input is not supported by this model"),
    ({"messages": QUESTION, "frobnicate": 1}, 400, "invalid_request_error", "frobnicate"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, 400,
     "invalid_request_error", "tool_result"),
])
def test_bad_requests_are_errors_in_anthropics_shape(url, body, status, kind, says):
    response = httpx.post(url + "/v1/messages", json={"model": "tiny", "max_tokens": 4} | body,
                          headers={"x-api-key": "sekret"})
    assert response.status_code == status
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
    assert says in response.json()["error"]["message"]
    missing = httpx.post(url + "/v1/messages", json={"model": "tiny", "messages": QUESTION},
                         headers={"x-api-key": "sekret"})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]


def test_a_bad_key_is_an_authentication_error(url):
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic.Anthropic(base_url=url, api_key="wrong").messages.create(model="tiny", max_tokens=4,
                                                                           messages=QUESTION)
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_an_output_format_constrains_the_answer(client):
    message = client.messages.create(model="tiny", max_tokens=300, messages=QUESTION, **GREEDY,
                                      thinking={"type": "disabled"},
                                      output_config={"format": {"type": "json_schema", "schema": SCHEMAS["add"]}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), SCHEMAS["add"])
