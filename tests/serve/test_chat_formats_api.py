"""Reasoning and each family's tool-call format through chat completions and the official openai
client, against the app on the real engine (tiny random models with the families' real chat
templates, tests/data/chat_templates): forced calls come back as `tool_calls` whose arguments
validate, streamed and not alike, in Hermes (Qwen3), Llama 3's JSON, Mistral's [TOOL_CALLS] and
gpt-oss's harmony; a reasoning model's thinking comes back apart from its answer
(`reasoning_content`, and `reasoning`), streamed and not alike, with a JSON schema constraining the
answer only; reasoning_effort reaches the templates that take it (a 400 elsewhere), and
chat_template_kwargs every template, which renders those it reads."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import served_real_engine

from tests.conftest import save_tiny_chat_model
from tests.engine.test_chat_formats import DESCRIBED
from tests.engine.test_tools import ADD, SCHEMAS

MESSAGES = [{"role": "user", "content": "the cat sat on a mat"}]


@pytest.fixture(scope="module", params=["qwen3", "llama3", "mistral", "gpt_oss"])
def family(request, tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp(f"api-{request.param}"), request.param)
    with served_real_engine(model, 4096) as url:
        yield request.param, openai.OpenAI(base_url=url + "/v1", api_key="none"), url


def _streamed(stream) -> dict:
    out = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    for chunk in stream:
        for c in chunk.choices:
            out["content"] += c.delta.content or ""
            out["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for call in c.delta.tool_calls or []:
                got = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
    return out


def test_forced_calls_come_back_as_tool_calls_in_every_familys_format(family):
    name, client, _ = family
    kwargs = dict(model="tiny", messages=MESSAGES, tools=DESCRIBED, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200, temperature=0)
    if name == "qwen3":
        kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(**kwargs).choices[0]
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert whole.finish_reason == "tool_calls" and not (whole.message.content or "").strip()
    streamed = _streamed(client.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == \
        [(call.function.name, json.loads(call.function.arguments))]
    assert streamed["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("api-qwen3-reasoning"), "qwen3")
    with served_real_engine(model, 4096) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none"), url


def _post(url: str, path: str, **body) -> dict:
    return httpx.post(url + path, json={"model": "tiny", **body}).raise_for_status().json()


def test_reasoning_comes_apart_from_a_constrained_answer(qwen3):
    qwen3, url = qwen3
    ids = _post(url, "/tokenize", prompt="<think> </think> cat", add_special_tokens=False)["tokens"]
    bias = {str(ids[0]): 8, str(ids[-2]): 6, str(ids[-1]): 7}  # <think>, </think>, cat
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=300, temperature=0, logit_bias=bias,
                  response_format={"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}})
    whole = qwen3.chat.completions.create(**kwargs).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.message.model_extra["reasoning"] == reasoning and "think>" not in reasoning
    jsonschema.validate(json.loads(whole.message.content), ADD)
    streamed = _streamed(qwen3.chat.completions.create(**kwargs, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == (reasoning, whole.message.content)
    off = qwen3.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_extra["reasoning_content"] is None  # the template closed the section


def test_template_variables_reach_the_templates_that_take_them(family):
    name, client, url = family
    if name == "gpt_oss":  # its system message says "Reasoning: <effort>"
        prompt = _post(url, "/tokenize", messages=MESSAGES, chat_template_kwargs={"reasoning_effort": "high"})
        assert "Reasoning: high" in _post(url, "/detokenize", tokens=prompt["tokens"])["prompt"]
        effort = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, reasoning_effort="high")
        assert effort.usage.prompt_tokens == prompt["count"]
    else:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, reasoning_effort="high")
        assert raised.value.body["param"] == "reasoning_effort"
    plain = _post(url, "/tokenize", messages=MESSAGES)
    unread = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={
        "chat_template_kwargs": {"no_such_variable": True, "enable_thinking": False}})  # the template reads them
    if name != "qwen3":  # Qwen3's reads enable_thinking
        assert unread.usage.prompt_tokens == plain["count"]
