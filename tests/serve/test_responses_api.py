"""OpenAI's Responses API through the official openai client, against the app on the real engine
(a tiny random Qwen3 with Qwen3's chat template: think tags and Hermes calls): a response's
reasoning and text are the chat completion's for the same conversation; its stream's events come
in the API's order and accumulate (the client's own stream helper) into the same response; a JSON
schema constrains the answer; a forced call and its output, sent back by previous_response_id,
make a tool round trip; kept responses are read, listed and deleted by id, unknown ids are 404s;
background responses run after the POST answers, and are cancelled; unknown fields are 400s
naming them."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from conftest import served_real_engine

from tests.conftest import save_tiny_chat_model
from tests.engine.test_tools import ADD, TOOLS

QUESTION = "the cat sat on a mat"
FUNCTIONS = [{"type": "function", "name": t["function"]["name"], "description": "Does it.",
              "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("qwen3-chat"), "qwen3")
    with served_real_engine(model, 2048) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none")


def _text(response) -> tuple[str, str]:
    reasoning = "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or [])
    return reasoning, response.output_text


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    response = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=24,
                                       temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    message = chat.choices[0].message
    assert _text(response) == ((getattr(message, "reasoning_content", None) or ""), message.content)
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Be brief." and response.model == "tiny"


def test_the_stream_comes_in_the_apis_order_and_adds_up_to_the_response(client):
    kwargs = dict(model="tiny", input=QUESTION, max_output_tokens=300, temperature=0,  # completes: the JSON ends it
                  text={"format": {"type": "json_schema", "name": "add", "schema": ADD}},
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and whole.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for item in final.output:  # each item: added, its parts, done, in that order
        index = final.output.index(item)
        mine = [e.type for e in events if getattr(e, "output_index", None) == index]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"
    assert _text(final) == _text(whole)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text


def test_a_json_schema_constrains_the_answer(client):
    response = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=300, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "add", "schema": ADD}},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ADD)


def test_a_tool_round_trip_through_previous_response_id(client):
    first = client.responses.create(model="tiny", input=QUESTION, tools=FUNCTIONS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), ADD if call.name == "add" else TOOLS[0]["function"]["parameters"])
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=FUNCTIONS,
                                     max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, i.call_id, i.output) for i in items] == [("function_call_output", call.call_id, "3")]
    assert client.responses.retrieve(first.id).output[-1].call_id == call.call_id


def test_kept_responses_are_read_and_deleted_by_id_and_unknown_ones_are_404s(client):
    kept = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, store=False)
    for missing in (unkept.id, "resp_nonesuch"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.create(model="tiny", input="hi", previous_response_id=missing)
        assert raised.value.body["param"] == "previous_response_id" and missing in raised.value.body["message"]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_background_responses_run_after_the_post_and_are_cancelled(client):
    done = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=16, background=True)
    assert done.status in ("queued", "in_progress")
    for _ in range(600):
        done = client.responses.retrieve(done.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens > 0
    long = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=1500, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)


@pytest.mark.parametrize("kwargs,param", [
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(include=["message.output_text.logprobs"]), "include"),  # this model writes a reasoning section
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(truncation="auto"), "truncation"),
    (dict(input=[{"type": "input_image", "image_url": "x"}]), "input"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(reasoning={"effort": "high"}), "reasoning.effort"),
])
def test_what_is_not_implemented_is_refused_naming_the_field(client, kwargs, param):
    request = dict(model="tiny", input=QUESTION, max_output_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**request)
    assert raised.value.body["param"].startswith(param), raised.value.body
