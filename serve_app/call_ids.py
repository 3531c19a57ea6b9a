"""`own_serve_request_id()`: gives the calling task a Serve request id of its own.

Serve (2.60) indexes a custom request router's pending calls by the HTTP request's id, so
concurrent calls made for one HTTP request collide: all but one are never routed and their
routing task spins. Each task that calls a replica for a request (a job, a stream channel opened
while serving it) takes an id of its own, in its own context variables.
"""

from __future__ import annotations

import uuid


def own_serve_request_id() -> None:
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=uuid.uuid4().hex)
