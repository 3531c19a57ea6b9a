"""The one private Ray API the app calls (serve_app.serve_internals, checked on Ray 2.60.0), held to
what the app relies on: the metadata Serve builds for a handle call takes the calling task's
internal request id (which a custom request router indexes its pending calls by), and
`own_serve_request_id` gives each task an id of its own, apart from the HTTP request's it serves.
Fails when Ray changes either."""

from __future__ import annotations

import asyncio

from ray.serve._private.default_impl import (
    create_dynamic_handle_options,
    create_init_handle_options,
    get_request_metadata,
)
from ray.serve.context import _get_serve_request_context, _set_request_context

from serve_app.serve_internals import own_serve_request_id


def _call_metadata():
    return get_request_metadata(create_init_handle_options(), create_dynamic_handle_options(method_name="submit"))


def test_each_task_that_calls_for_a_request_routes_under_an_id_of_its_own():
    async def go():
        _set_request_context(_internal_request_id="the-http-request")
        assert _call_metadata().internal_request_id == "the-http-request"  # what collided before

        async def caller() -> str:
            own_serve_request_id()
            return _call_metadata().internal_request_id

        ids = await asyncio.gather(*(asyncio.ensure_future(caller()) for _ in range(3)))
        assert len(set(ids)) == 3 and "the-http-request" not in ids
        assert _get_serve_request_context()._internal_request_id == "the-http-request"  # the request's own kept

    asyncio.run(go())
