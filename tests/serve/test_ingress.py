"""OpenAI API surface through the real ingress/router/replica code on fake engines (no Ray)."""

from __future__ import annotations

import asyncio
import gc
import json

import httpx
import openai
import pytest
from conftest import greedy_text, local_app, local_stack, run, sse_events
from fake_engine import FakeAsyncEngine, FakeTokenizer

from engine.gc_settings import YOUNG_COLLECTION_OBJECTS
from serve_app.config import AppConfig
from serve_app.ingress import FrontEnd
from serve_app.messages import ModelInfo

TOK = FakeTokenizer()
SLOW_TOKENS = FakeAsyncEngine.with_options(step_delay_s=0.01)


def test_completion_non_streaming_text_usage_and_finish():
    async def go():
        async with local_stack() as (client, _, _):
            r = await client.post("/v1/completions", json={
                "model": "fake", "prompt": "hello world", "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            ids = TOK.encode("hello world")
            assert body["object"] == "text_completion"
            assert body["choices"][0]["text"] == greedy_text(ids, 5)
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}

    run(go())


def test_completion_streaming_sse_done_and_usage_last():
    async def go():
        async with local_stack() as (client, _, _):
            r = await client.post("/v1/completions", json={
                "prompt": "hello world", "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            usage_event = events[-2]
            assert usage_event["choices"] == []
            assert usage_event["usage"]["completion_tokens"] == 6
            assert usage_event["usage"]["prompt_tokens"] == 2
            chunks = events[:-2]
            assert all(c["usage"] is None for c in chunks)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert text == greedy_text(TOK.encode("hello world"), 6)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    run(go())


def test_a_streams_events_that_arrive_together_share_a_body_message_and_the_last_ends_it():
    """Each ASGI body message is a socket write: the two choices' events of each step go in one
    message, and the last message carries the usage event and [DONE] and ends the response."""
    async def go():
        async with local_app() as (app, _, _):
            body = json.dumps({"prompt": "hello world", "max_tokens": 4, "temperature": 0, "n": 2, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            sent, received = [], [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:
                if received:
                    return received.pop()
                await asyncio.Event().wait()  # the client stays until the response ends

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                     "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("test", 80)}
            await app(scope, receive, send)
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
            bodies = sent[1:]
            assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
            events = sse_events(b"".join(m["body"] for m in bodies).decode())
            chunks = [e for e in events[:-2] if e["choices"]]
            assert len(chunks) == 8  # four tokens for each of the two choices
            assert len(bodies) <= 4 + 1  # a message a step, and the end
            for n in range(2):
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == n)
                assert text == greedy_text(TOK.encode("hello world"), 4)
            last = sse_events(bodies[-1]["body"].decode())
            assert last[-1] == "[DONE]" and last[-2]["usage"]["completion_tokens"] == 8

    run(go())


def _streamed_completion(app, sent: list[dict], disconnected: asyncio.Event, max_tokens: int):
    """The app's answer to a streamed completion over raw ASGI: its messages go to `sent`; the
    client disconnects when `disconnected` is set."""
    body = json.dumps({"prompt": "hello world", "max_tokens": max_tokens, "stream": True}).encode()
    received = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if received:
            return received.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    return app(scope, receive, send)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_client_that_disconnects_mid_stream_ends_the_response_and_its_request_in_the_engine():
    """A 200-token stream (2 s at 10 ms a token): the client leaves after two events, the response
    ends at once without an error, and the engine aborts the request (its slot and blocks freed)."""
    async def go():
        async with local_app(engine_cls=SLOW_TOKENS) as (app, _, replicas):
            sent, disconnected = [], asyncio.Event()
            answer = asyncio.ensure_future(_streamed_completion(app, sent, disconnected, max_tokens=200))
            await _until(lambda: len(sent) >= 3)
            disconnected.set()
            await asyncio.wait_for(answer, 1.0)
            engine = replicas[0].engine
            await _until(lambda: engine.aborted)
            assert engine.stats().num_running == 0 and not engine.finished
            assert len(sent) < 50 and sent[-1]["more_body"] is True  # ended early, not by the stream's end

    run(go())


def test_the_servers_cancellation_of_a_stream_is_not_taken_for_the_clients_disconnect():
    async def go():
        async with local_app(engine_cls=SLOW_TOKENS) as (app, _, replicas):
            sent = []
            answer = asyncio.ensure_future(_streamed_completion(app, sent, asyncio.Event(), max_tokens=200))
            await _until(lambda: len(sent) >= 3)
            answer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await answer
            await _until(lambda: replicas[0].engine.aborted)

    run(go())


def test_chat_streaming_role_first_and_text_matches_non_streaming():
    async def go():
        async with local_stack() as (client, _, _):
            req = {"model": "fake", "messages": [{"role": "user", "content": "hi there"}],
                   "max_tokens": 4, "temperature": 0}
            full = (await client.post("/v1/chat/completions", json=req)).json()
            assert full["object"] == "chat.completion"
            assert full["choices"][0]["message"]["role"] == "assistant"
            r = await client.post("/v1/chat/completions", json={**req, "stream": True})
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert events[0]["object"] == "chat.completion.chunk"
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the role alone
            assert all("role" not in e["choices"][0]["delta"] for e in events[1:-1])
            text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
            assert text == full["choices"][0]["message"]["content"]
            ids = TOK.apply_chat_template([{"role": "user", "content": "hi there"}])
            assert text == greedy_text(ids, 4)
            assert full["usage"]["prompt_tokens"] == len(ids)

    run(go())


def test_n_seed_reproducible_and_stop_strings():
    async def go():
        async with local_stack() as (client, _, _):
            req = {"prompt": "a b", "max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0}
            a = (await client.post("/v1/completions", json=req)).json()
            b = (await client.post("/v1/completions", json=req)).json()
            assert [c["index"] for c in a["choices"]] == [0, 1, 2]
            assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
            assert len({c["text"] for c in a["choices"]}) > 1
            assert a["usage"]["completion_tokens"] == 24
            # stop on the 3rd greedy token
            ids = TOK.encode("a b")
            third = greedy_text(ids, 3).split(" ")[-1]
            r = (await client.post("/v1/completions", json={
                "prompt": "a b", "max_tokens": 8, "temperature": 0, "stop": [" " + third]})).json()
            assert r["choices"][0]["text"] == greedy_text(ids, 2)
            assert r["choices"][0]["finish_reason"] == "stop"

    run(go())


def test_prompt_list_and_token_ids():
    async def go():
        async with local_stack(num_replicas=2) as (client, _, _):
            r = (await client.post("/v1/completions", json={
                "prompt": ["x y", "z"], "n": 2, "max_tokens": 3, "temperature": 0})).json()
            assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
            assert r["choices"][0]["text"] == greedy_text(TOK.encode("x y"), 3)
            assert r["choices"][2]["text"] == greedy_text(TOK.encode("z"), 3)
            assert r["usage"]["prompt_tokens"] == 3
            r = (await client.post("/v1/completions", json={
                "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0})).json()
            assert r["choices"][0]["text"] == greedy_text([11, 12, 13], 2)
            r = (await client.post("/v1/completions", json={
                "prompt": [[11], [12, 13]], "max_tokens": 2, "temperature": 0})).json()
            assert len(r["choices"]) == 2

    run(go())


def test_logprobs_shapes():
    async def go():
        async with local_stack() as (client, _, _):
            r = (await client.post("/v1/completions", json={
                "prompt": "q", "max_tokens": 2, "temperature": 0, "logprobs": 2})).json()
            lp = r["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == 2 and lp["token_logprobs"] == [-0.5, -0.5]
            assert len(lp["top_logprobs"][0]) == 2
            r = (await client.post("/v1/completions", json={
                "prompt": "q", "max_tokens": 2, "temperature": 0.8, "seed": 1, "logprobs": 0})).json()
            lp = r["choices"][0]["logprobs"]  # the token itself alone, as vLLM gives it
            assert [list(top.items()) for top in lp["top_logprobs"]] == [
                [(token, logprob)] for token, logprob in zip(lp["tokens"], lp["token_logprobs"])]
            r = (await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                "logprobs": True, "top_logprobs": 1})).json()
            content = r["choices"][0]["logprobs"]["content"]
            assert len(content) == 2 and len(content[0]["top_logprobs"]) == 1

    run(go())


def test_models_health_and_api_keys():
    async def go():
        async with local_stack(ingress={"api_keys": ["sekret"]}) as (client, _, _):
            assert (await client.get("/health")).status_code == 200
            r = await client.get("/v1/models")
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            assert r.json()["data"][0]["id"] == "fake"
            r = await client.post("/v1/completions", json={"prompt": "x"},
                                  headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401

    run(go())


class _Fleet:
    """An admission as the ingress's health sees it: how many engine replicas of the model take requests."""
    ready = 0

    async def ready_replicas(self) -> dict[str, int]:
        return {"fake": self.ready}

    async def check_health(self) -> None:
        pass


class _Engines:
    """Engine replicas that count the model-info calls they answer (or fail them)."""
    calls = 0
    fails = False

    async def model_info(self) -> ModelInfo:
        self.calls += 1
        if self.fails:
            raise RuntimeError("engine replica died")
        return ModelInfo("fake", 256, 16, 100, 8, FakeTokenizer(), FakeAsyncEngine.chat_format)

    async def check_health(self) -> None:
        pass


def test_the_ingress_collects_its_requests_young_objects_less_often():
    gc.set_threshold(700)  # Python's default
    FrontEnd(AppConfig.model_validate({"engine": {"served_model_name": "fake"}}), _Fleet(), {"fake": _Engines()})
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_OBJECTS


def test_the_health_checks_load_the_models_info_once_an_engine_replica_is_ready():
    """The engine's tokenizer comes over to the ingress once (unpickled with transformers: slow),
    so Serve's periodic check and /health load it before any request needs it, and only once an
    engine replica is ready; a failed load is retried, and does not fail the ingress's check."""
    async def go():
        fleet, engines = _Fleet(), _Engines()
        config = AppConfig.model_validate({"engine": {"served_model_name": "fake"}})
        ingress = FrontEnd(config, fleet, {"fake": engines})
        transport = httpx.ASGITransport(app=ingress.build_asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await ingress.check_health()
            assert (await client.get("/health")).status_code == 503
            assert engines.calls == 0  # no engine replica to ask
            fleet.ready, engines.fails = 1, True
            await ingress.check_health()  # logged, not raised
            assert (await client.get("/health")).status_code == 503
            assert engines.calls == 2
            engines.fails = False
            await ingress.check_health()
            assert engines.calls == 3
            await ingress.check_health()
            assert (await client.get("/health")).status_code == 200
            assert engines.calls == 3  # loaded once
            assert (await ingress.models["fake"].load_info()).served_model_name == "fake"  # what a request reads
            assert engines.calls == 3

        fresh = _Engines()
        ingress = FrontEnd(AppConfig.model_validate({"engine": {"served_model_name": "fake"}}), fleet, {"fake": fresh})
        transport = httpx.ASGITransport(app=ingress.build_asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            assert fresh.calls == 1  # /health alone loads it too

    run(go())


BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, "Malformed JSON"),
    ("not an object", "/v1/completions", b'[1, 2]', 400, "JSON object"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400,
     "max_tokens"),
    ("temperature -1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p 2", "/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("n 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt over context", "/v1/completions", {"prompt": "w " * 300, "max_tokens": 4}, 400,
     "maximum context length is 256 tokens. However, you requested 304 tokens (300 in the"),
    ("max_tokens over context", "/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400,
     "256"),
    ("token id out of vocab", "/v1/completions", {"prompt": [999]}, 400, "prompt"),
    ("token id a bool", "/v1/completions", {"prompt": [5, True]}, 400, "prompt must be"),
    ("token id negative", "/v1/completions", {"prompt": [5, -1]}, 400, "outside the vocabulary"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("a role the template refuses", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400, "could not apply the chat template: bad role wizard"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("huge body", "/v1/completions", {"prompt": "x" * 5000}, 413, "exceeds the limit"),
    ("unknown field", "/v1/completions", {"prompt": "x", "service_tier": "flex"}, 400,
     "Unrecognized request argument supplied: service_tier"),
    ("response_format unknown type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400, "response_format"),
    ("response_format json_schema missing", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ("response_format invalid schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}}, 400,
     "response_format: invalid JSON schema"),
    ("json_schema without name", "/v1/completions",
     {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "name"),
    ("two output constraints", "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "give one output constraint"),
    ("structured_outputs empty", "/v1/completions", {"prompt": "x", "structured_outputs": {}}, 400,
     "exactly one of"),
    ("structured_outputs unknown kind", "/v1/completions", {"prompt": "x", "structured_outputs": {"jsonn": {}}},
     400, "Unrecognized request argument supplied: structured_outputs.jsonn"),
    ("guided_choice wrong type", "/v1/completions", {"prompt": "x", "guided_choice": "a"}, 400, "guided_choice"),
    ("guided_json not json", "/v1/completions", {"prompt": "x", "guided_json": "{nope"}, 400, "not valid JSON"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options is only allowed with stream"),
    ("an image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 400,
     "image_url input is not supported by this model"),
    ("tool_calls on a user message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "tool_calls is only for assistant"),
    ("tool message without tool_call_id", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]}, 400, "tool_call_id"),
    ("tool call arguments not JSON", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]}, 400, "not JSON"),
    ("tools wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": {}},
     400, "tools"),
    ("tool without function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("tool name invalid", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, 400, "function name must match"),
    ("tool parameters invalid schema", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]}, 400,
     "the parameters of f: invalid JSON schema"),
    ("tool names repeated", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}, 400,
     "unique"),
    ("tool_choice unknown", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tool_choice": "always"}, 400, "tool_choice"),
    ("tool_choice without tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tool_choice": "required"}, 400, "tool_choice 'required' needs tools"),
    ("tool_choice names a missing tool", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not in tools"),
    ("tool_choice with response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
     "response_format": {"type": "json_object"}}, 400, "it cannot be given with a structured output"),
    ("beam search with temperature", "/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.7},
     400, "temperature does not apply to beam search"),
    ("beam search with logprobs", "/v1/completions", {"prompt": "x", "use_beam_search": True, "logprobs": 2}, 400,
     "logprobs does not apply to beam search"),
    ("length_penalty without beam search", "/v1/completions", {"prompt": "x", "length_penalty": 0.5}, 400,
     "length_penalty applies to beam search only"),
    ("length_penalty out of range", "/v1/completions", {"prompt": "x", "use_beam_search": True,
                                                        "length_penalty": 11.0}, 400, "length_penalty must be"),
    ("use_beam_search wrong type", "/v1/completions", {"prompt": "x", "use_beam_search": "yes"}, 400,
     "use_beam_search"),
    ("parallel_tool_calls wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    ("logit_bias key not an id", "/v1/completions", {"prompt": "x", "logit_bias": {"cat": 5}}, 400, "logit_bias"),
    ("logit_bias over 100", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias id out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("logit_bias wrong type", "/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("min_tokens negative", "/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("min_tokens over max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens"),
    ("min_tokens wrong type", "/v1/completions", {"prompt": "x", "min_tokens": 1.5}, 400, "min_tokens"),
    ("best_of under n", "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of streamed", "/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("echo with logprobs over 20", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, 400,
     "logprobs"),
    ("continuous_usage_stats wrong type", "/v1/completions",
     {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400, "continuous_usage_stats"),
    ("user wrong type", "/v1/completions", {"prompt": "x", "user": 7}, 400, "user"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [999]}, 400, "tokens"),
    ("detokenize empty", "/detokenize", {"tokens": []}, 400, "tokens"),
    ("tokenize unknown field", "/tokenize", {"prompt": "x", "add_special_token": True}, 400,
     "Unrecognized request argument supplied: add_special_token"),
    ("tokenize chat bad role", "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
]


@pytest.mark.parametrize("name,path,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_matrix(name, path, body, status, needle):
    async def go():
        async with local_stack(ingress={"max_body_bytes": 4096}) as (client, _, replicas):
            if isinstance(body, bytes):
                r = await client.post(path, content=body,
                                      headers={"content-type": "application/json"})
            else:
                r = await client.post(path, json=body)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert needle in err["message"], err
            # the replica keeps serving
            ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200
            assert not replicas[0].engine._running

    run(go())


def test_unknown_fields_are_dropped_and_logged_with_the_switch_on(caplog):
    async def go():
        async with local_stack(ingress={"ignore_unknown_fields": True}) as (client, _, _):
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "response_format": {"type": "text", "vendor_tag": 1}, "temperature": 0, "vendor_field": {"a": 1}})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == greedy_text(
                TOK.apply_chat_template([{"role": "user", "content": "hi"}]), 3)
            bad = await client.post("/v1/completions", json={"prompt": "x", "vendor": 1, "top_p": 2})
            assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]  # known fields still checked

    with caplog.at_level("INFO", logger="cbserve.ingress"):
        run(go())
    assert any("vendor_field" in r.message and "response_format.vendor_tag" in r.message for r in caplog.records)


def test_echo_prepends_each_prompt_streamed_and_not():
    async def go():
        async with local_stack() as (client, _, _):
            for prompts, texts in (
                    (["hello world", "t7 t8"], ["hello world", "t7 t8"]),  # as written
                    ([[7, 8], [9]], [TOK.decode([7, 8]), TOK.decode([9])])):  # token ids decoded
                body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": True, "n": 2}
                ids = [TOK.encode(p) if isinstance(p, str) else p for p in prompts]
                expected = [text + greedy_text(i, 3) for text, i in zip(texts, ids) for _ in range(2)]
                full = (await client.post("/v1/completions", json=body)).json()
                assert [c["text"] for c in sorted(full["choices"], key=lambda c: c["index"])] == expected
                events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
                streamed: dict[int, str] = {}
                for event in events[:-1]:
                    for choice in event["choices"]:
                        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
                assert [streamed[i] for i in range(4)] == expected

    run(go())


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    async def go():
        async with local_stack() as (client, _, _):
            r = await client.post("/v1/completions", json={
                "prompt": "hello world", "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            chunks = [e for e in sse_events(r.text)[:-1] if e["choices"]]
            completion = [c["usage"]["completion_tokens"] for c in chunks]
            assert completion == sorted(completion) and completion[-1] == 4 and len(chunks) >= 2
            assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)

    run(go())


def test_tokenize_detokenize_version_and_model_cards():
    async def go():
        async with local_stack() as (client, _, _):
            r = (await client.post("/tokenize", json={"prompt": "hello t5", "return_token_strs": True})).json()
            ids = TOK.encode("hello t5")
            assert r == {"count": 2, "max_model_len": 256, "tokens": ids, "token_strs": TOK.convert_ids_to_tokens(ids)}
            messages = [{"role": "user", "content": "hi"}]
            chat = (await client.post("/tokenize", json={"messages": messages})).json()
            assert chat["tokens"] == TOK.apply_chat_template(messages)
            bare = (await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
            assert bare["tokens"] == TOK.apply_chat_template(messages, add_generation_prompt=False)
            assert (await client.post("/detokenize", json={"tokens": [5, 9]})).json() == {"prompt": TOK.decode([5, 9])}
            assert (await client.get("/version")).json()["version"]
            listed = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["fake"] and listed[0]["max_model_len"] == 256 and listed[0]["root"]
            assert (await client.get("/v1/models/fake")).json() == listed[0]
            assert (await client.get("/v1/models/other")).status_code == 404

    run(go())


def test_openai_client_async_streaming_and_not():
    async def go():
        async with local_stack() as (client, _, _):
            oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none",
                                     http_client=client)
            c = await oai.completions.create(model="fake", prompt="hello world", max_tokens=4,
                                             temperature=0)
            assert c.choices[0].text == greedy_text(TOK.encode("hello world"), 4)
            assert c.usage.completion_tokens == 4
            stream = await oai.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "yo"}], max_tokens=3,
                stream=True, stream_options={"include_usage": True}, temperature=0)
            parts, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                if chunk.usage:
                    usage = chunk.usage
            assert "".join(parts) == greedy_text(TOK.apply_chat_template(
                [{"role": "user", "content": "yo"}]), 3)
            assert usage.completion_tokens == 3
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="nope", prompt="x")
            with pytest.raises(openai.BadRequestError, match="temperature"):
                await oai.completions.create(model="fake", prompt="x", temperature=-1)
            r = await oai.completions.create(model="fake", prompt="x", max_tokens=2,
                                             extra_body={"top_k": 5, "priority": 3,
                                                         "ignore_eos": True})
            assert r.choices[0].finish_reason == "length"

    run(go())


def test_context_length_check_uses_chat_template_count():
    async def go():
        async with local_stack() as (client, _, _):
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w " * 260}]})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded"
            # default chat max_tokens = the rest of the context
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w " * 240}], "temperature": 0})
            assert r.status_code == 200
            assert r.json()["usage"]["total_tokens"] == 256

    run(go())


def test_http_transport_client_is_httpx():  # guard: tests above rely on httpx ASGI transport
    assert hasattr(httpx, "ASGITransport")


def test_every_api_route_is_served_once_and_every_formatter_is_composed_not_derived():
    """Each API module's routes reach the app as declared, no path and method twice, and errors on
    Anthropic's routes take Anthropic's shape; no formatter derives from another class."""
    import inspect

    import serve_app.api.anthropic
    import serve_app.api.chat
    import serve_app.api.completions
    import serve_app.api.embeddings
    import serve_app.api.responses

    async def go():
        async with local_app() as (app, _, _):
            served = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}
            front = FrontEnd(AppConfig.model_validate({"engine": {"served_model_name": "fake"}}), _Fleet(),
                             {"fake": _Engines()})
            declared = [(r.method, r.path) for r in front.routes]
            assert len(declared) == len(set(declared)) and set(declared) <= served
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                anthropic = await client.post("/v1/messages", json={"model": "fake", "max_tokens": 1, "messages": []})
                openai_shaped = await client.post("/v1/chat/completions", json={"model": "fake", "messages": []})
            assert anthropic.status_code == openai_shaped.status_code == 400
            assert anthropic.json()["type"] == "error" and "message" in anthropic.json()["error"]
            assert openai_shaped.json()["error"]["param"] == "messages"

    run(go())
    formatters = [cls for module in (serve_app.api.anthropic, serve_app.api.chat, serve_app.api.completions,
                                     serve_app.api.embeddings, serve_app.api.responses)
                  for _, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and cls.__name__.endswith("Formatter")]
    assert len(formatters) == 5 and all(cls.__bases__ == (object,) for cls in formatters)


def test_a_conversation_sends_back_every_field_of_the_answer_and_only_the_template_reads_them():
    """Clients send an answer back as they got it (and with keys of their own): accepted, and the
    prompt is what the template renders of it, here the role and the content alone."""
    async def go():
        async with local_stack() as (client, _, _):
            question = {"role": "user", "content": "x", "id": "m1"}
            first = await client.post("/v1/chat/completions", json={"messages": [question], "max_tokens": 3})
            answer = first.json()["choices"][0]["message"] | {"refusal": None, "annotations": []}
            assert set(answer) >= {"role", "content", "reasoning_content", "reasoning", "tool_calls"}
            follow_up = {"role": "user", "content": "y"}
            kept = await client.post("/v1/chat/completions", json={"messages": [question, answer, follow_up],
                                                                  "max_tokens": 1})
            plain = await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": answer["content"]}, follow_up]})
            assert kept.status_code == plain.status_code == 200
            assert kept.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]

    run(go())


def test_thinking_asked_of_a_model_that_has_no_switch_for_it_is_taken_as_llama_cpp_takes_it():
    """Agent clients send `thinking` to every model: one whose template has no enable_thinking
    answers as it always does, here with text alone."""
    async def go():
        async with local_stack() as (client, _, _):
            r = await client.post("/v1/messages", json={"model": "fake", "max_tokens": 3, "messages": [
                {"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}})
            assert r.status_code == 200 and [block["type"] for block in r.json()["content"]] == ["text"]

    run(go())


def test_a_response_includes_its_texts_logprobs_when_asked_streamed_and_not():
    async def go():
        async with local_stack() as (client, _, _):
            body = {"model": "fake", "input": "hi", "max_output_tokens": 3, "temperature": 0,
                    "include": ["message.output_text.logprobs"], "top_logprobs": 1}
            whole = (await client.post("/v1/responses", json=body)).json()
            [part] = whole["output"][0]["content"]
            assert [e["token"] for e in part["logprobs"]] == [f" t{i}" for i in _ids_of(part["text"])]
            assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 1 for e in part["logprobs"])
            streamed = (await client.post("/v1/responses", json=body | {"stream": True})).text
            events = [json.loads(line[len("data: "):]) for line in streamed.splitlines() if line.startswith("data: ")]
            deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
            assert deltas == part["logprobs"]
            plain = (await client.post("/v1/responses", json=body | {"include": None})).json()
            assert plain["output"][0]["content"][0]["logprobs"] == []
            refused = await client.post("/v1/responses", json=body | {"tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "include"

    run(go())


def _ids_of(text: str) -> list[int]:
    """The fake tokenizer's ids of its own decoded text (" t5 t9" -> [5, 9])."""
    return [int(word[1:]) for word in text.split()]
