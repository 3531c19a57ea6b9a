"""Schemathesis fuzzes the app's own OpenAPI schema (/openapi.json) over HTTP: the in-process
stack (real ingress, router and replica code) on the real engine (tiny random Llama, step loop
in its child process) behind uvicorn. Every operation gets bounded positive examples (valid per
the schema) and negative ones (violating it). No response may be a 5xx, and every error is in
its API's shape (Anthropic's under /v1/messages, OpenAI's elsewhere); the server still answers a
normal request at the end. Counts are printed
(`-s`) for RELIABILITY.md."""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
import schemathesis.specs.openapi.schemas  # noqa: F401  loaded (and rewritten by pytest) at collection, not deep in a test's stack
from conftest import served_real_engine
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

KEY = {"Authorization": "Bearer fuzz"}
EXAMPLES_PER_MODE = 100


@pytest.fixture(scope="module")
def server(tiny_llama_words):
    with served_real_engine(tiny_llama_words, 96, ingress={"api_keys": ["fuzz"], "body_timeout_s": 5.0}) as url:
        yield url


def test_no_generated_request_gets_a_5xx_and_every_error_is_openai_shaped(server):
    schema = schemathesis.openapi.from_url(server + "/openapi.json", headers=KEY)
    statuses: collections.Counter = collections.Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                                              "/detokenize", "/v1/models/{model_id}", "/version", "/v1/responses",
                                              "/v1/responses/{response_id}", "/v1/messages", "/v1/embeddings"}
    for operation in operations:
        has_body = bool(list(operation.body))  # a path's free-form string (a model id) has no invalid value
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:1 + has_body]:
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def fuzz(case):
                response = case.call(base_url=server, headers=KEY, timeout=60)
                statuses[response.status_code // 100] += 1
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400 and case.operation.path.startswith("/v1/messages"):  # Anthropic's shape
                    body = response.json()
                    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text
                    assert body["error"]["message"], response.text
                elif response.status_code >= 400:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}, response.text
                    assert error["message"], response.text

            fuzz()
    print(f"fuzzed {sum(statuses.values())} requests over {len(operations)} operations: "
          f"{dict(sorted(statuses.items()))} (status // 100 -> count)")
    assert statuses[2] > 0 and statuses[4] > 0
    ok = httpx.post(server + "/v1/completions", json={"prompt": "the cat", "max_tokens": 3}, headers=KEY, timeout=30)
    assert ok.status_code == 200, ok.text
