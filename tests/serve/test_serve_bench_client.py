"""serve_bench's HTTP client: SSE events however the body is cut, refusals and truncated streams
reported as errors, usage counted from the served stream."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import served_local_stack

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.workload import Request, Workload  # noqa: E402


class _Body:
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def _data(body: bytes, cut: int) -> list[str]:
    pieces = [body[i:i + cut] for i in range(0, len(body), cut)]

    async def collect() -> list[str]:
        return [d async for d in serve_bench._sse_data(SimpleNamespace(content=_Body(pieces)))]

    return asyncio.run(collect())


def test_sse_payloads_are_whole_however_the_body_arrives():
    long_text = "x" * 200_000  # longer than aiohttp's own line reader takes
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": long_text}]}, {"usage": {"completion_tokens": 2}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b": comment\n\ndata: [DONE]\n\n"
    for cut in (1, 7, 4096, len(body)):
        data = _data(body, cut)
        assert data[-1] == "[DONE]"
        assert [json.loads(d) for d in data[:-1]] == events


def _run(url: str, workload: Workload, *flags: str) -> list[serve_bench.RequestResult]:
    args = serve_bench.parse_args(["--base-url", url + "/v1", "--model", "fake", "--warmup", "0",
                                   "--num-requests", str(len(workload.requests)), *flags])
    results, _, _ = asyncio.run(serve_bench.run_http(args, workload, args.base_url, "fake", None))
    return results


def test_the_client_counts_served_tokens_and_reports_refusals():
    workload = Workload([Request(i, [1 + i, 2, 3], 3 + i) for i in range(6)])
    config = {"engine": {"served_model_name": "fake", "stream_flush_interval_s": 0.0}}
    with served_local_stack(config) as (url, _, _):
        served = _run(url, workload)
        refused = _run(url, workload, "--extra-body", '{"temperature": -1}')
    assert all(r.ok for r in served), [r.error for r in served]
    assert [r.output_tokens for r in served] == [3 + i for i in range(6)]
    assert all(r.usage_present and r.prompt_tokens == 3 and r.ttft_s is not None for r in served)
    assert all(r.num_events == r.output_tokens and r.finish_reason == "length" for r in served)
    assert all(not r.ok and r.status == 400 and r.error.startswith("HTTP 400:") for r in refused)
    assert all("temperature" in r.error for r in refused)


def test_a_stream_cut_before_its_end_is_an_error():
    async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        # `connection: close`: the client must not reuse this connection for its next request (it
        # lists the models first), or that request could meet the closed socket instead of this reply
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                     b"connection: close\r\n\r\n"
                     + b"%x\r\n" % len(event) + event + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> list[serve_bench.RequestResult]:
        server = await asyncio.start_server(cut_short, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await asyncio.to_thread(_run, f"http://127.0.0.1:{port}", Workload([Request(0, [1, 2], 4)]))

    (result,) = asyncio.run(main())
    assert not result.ok and result.status == 200 and result.error == "stream ended without [DONE]"
