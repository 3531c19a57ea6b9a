"""The HTTP edge against hostile and sloppy clients, in process (real ingress, router and
replica code on the fake engine): strict types, content types, JSON Python cannot take, bodies
that never finish, priorities out of range, keys, requests that could never be admitted, and
readiness. Every error is a 4xx/5xx in OpenAI's shape and the server keeps serving."""

from __future__ import annotations

import asyncio

import pytest
from conftest import local_stack, one_lane, run

ERROR_KEYS = {"message", "type", "param", "code"}


async def _ok(client, **headers) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text


def _assert_error(r, status: int, needle: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and needle in err["message"], err
    return err


LOOSE_TYPES = [
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"prompt": "x", "priority": "1"}, "priority"),
]


@pytest.mark.parametrize("body, field", LOOSE_TYPES, ids=[repr(b) for b, _ in LOOSE_TYPES])
def test_loose_types_are_400_naming_the_field(body, field):
    async def go():
        async with local_stack() as (client, _, _):
            err = _assert_error(await client.post("/v1/completions", json=body), 400, field)
            assert err["param"].split(".")[0] == field
            await _ok(client)

    run(go())


OUT_OF_RANGE = [
    ({"prompt": "x", "top_k": 2**63}, "top_k"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "max_tokens": 10**400}, "max_tokens"),
    ({"prompt": "x", "priority": 10**400}, "priority"),
    ({"prompt": "x", "priority": -10**18}, "priority"),
    ({"prompt": "x", "priority": 11}, "priority"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
]


@pytest.mark.parametrize("body, field", OUT_OF_RANGE, ids=[b[1] + "-" + str(i) for i, b in enumerate(OUT_OF_RANGE)])
def test_values_outside_the_engines_ranges_are_400_and_change_nothing(body, field):
    async def go():
        async with local_stack() as (client, router, replicas):
            err = _assert_error(await client.post("/v1/completions", json=body), 400, field)
            assert err["param"] == field
            assert len(one_lane(router).queue) == 0 and not replicas[0].engine.started
            await _ok(client)

    run(go())


BAD_BODIES = [
    ("deep nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "Malformed JSON"),
    ("5,000-digit int", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "Malformed JSON"),
    ("NaN", b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
    ("lone surrogate prompt", b'{"prompt": "abc\\ud800def"}', 400, "Malformed JSON"),
    ("lone surrogate chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "Malformed JSON"),
]


@pytest.mark.parametrize("name, body, status, needle", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_json_python_cannot_take_is_a_400(name, body, status, needle):
    async def go():
        async with local_stack(ingress={"max_body_bytes": 1 << 20}) as (client, _, _):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            _assert_error(r, status, needle)
            await _ok(client)

    run(go())


def test_content_type_404_and_405_are_answered_in_openai_shape():
    async def go():
        async with local_stack() as (client, _, _):
            _assert_error(await client.post("/v1/completions", content=b'{"prompt": "x"}',
                                            headers={"content-type": "text/plain"}), 415, "application/json")
            _assert_error(await client.post("/v1/completions", content=b'{"prompt": "x"}'), 415)
            _assert_error(await client.get("/v1/nothing"), 404)
            _assert_error(await client.get("/v1/completions"), 405)
            _assert_error(await client.delete("/v1/models"), 405)

    run(go())


def test_a_body_that_never_finishes_gets_408():
    async def go():
        async with local_stack(ingress={"body_timeout_s": 0.3}) as (client, _, _):
            async def trickle():
                yield b'{"prompt": '
                await asyncio.sleep(5)
                yield b'"x"}'

            r = await client.post("/v1/completions", content=trickle(),
                                  headers={"content-type": "application/json"})
            _assert_error(r, 408, "not received within 0.3 s")
            await _ok(client)

    run(go())


def test_too_many_prompts_or_more_work_than_the_queue_holds_is_refused_at_once():
    """Requests that could never be admitted get 400/413 naming the bound, not a 429 after a
    wait: 300 prompts over max_prompts_per_request (64); work over router.max_queued_tokens. A
    request with more prompts than the fleet admits at once (8 on one replica that runs 4 and
    queues 2) completes: each prompt gives its slot back when it finishes."""
    async def go():
        async with local_stack(router={"max_queued_tokens": 500}) as (client, router, _):
            err = _assert_error(await client.post("/v1/completions", json={"prompt": ["hi"] * 300}), 400,
                                "at most 64 prompts")
            assert err["code"] == "too_many_prompts"
            err = _assert_error(await client.post("/v1/completions", json={
                "prompt": ["hi"] * 4, "max_tokens": 100, "n": 2}), 413, "holds at most 500")
            assert err["code"] == "request_too_large" and len(one_lane(router).queue) == 0
            r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c", "d", "e", "f", "g", "h"],
                                                            "max_tokens": 3})
            assert r.status_code == 200 and len(r.json()["choices"]) == 8

    run(go())


def test_priority_range_is_narrowed_per_api_key_and_keys_guard_the_schema():
    """Router range [0, 10]; key "batch" may only use [5, 10] and defaults to 5; key "ops" gets
    the full range. /openapi.json needs a key like every other route."""
    async def go():
        keys = ["ops", {"key": "batch", "priority_range": [5, 10]}]
        async with local_stack(ingress={"api_keys": keys}) as (client, router, replicas):
            batch, ops = {"Authorization": "Bearer batch"}, {"Authorization": "Bearer ops"}

            async def post(headers, **body):
                return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **body},
                                         headers=headers)

            _assert_error(await post(batch, priority=0), 400, "[5, 10]")
            assert (await post(batch, priority=7)).status_code == 200
            assert (await post(ops, priority=0)).status_code == 200
            _assert_error(await post({"Authorization": "Bearer nope"}), 401)
            _assert_error(await post({}), 401)
            _assert_error(await client.get("/openapi.json"), 401)
            schema = (await client.get("/openapi.json", headers=ops)).json()
            assert "CompletionRequest" in schema["components"]["schemas"]
            await _ok(client, **batch)

    run(go())


def test_health_is_ready_only_with_a_ready_engine_replica():
    async def go():
        async with local_stack() as (client, router, replicas):
            r = await client.get("/health")
            assert r.status_code == 200 and r.json()["ready_replicas"] == 1
            replicas[0].engine.is_ready = False  # its step loop restarting
            await asyncio.sleep(0.2)
            _assert_error(await client.get("/health"), 503, "no engine replica is ready")
            replicas[0].engine.is_ready = True
            await asyncio.sleep(0.2)
            assert (await client.get("/health")).status_code == 200

    run(go())
