"""The one place the app reaches into Ray's private API (checked on Ray 2.60.0; tests/serve/test_serve_internals.py
fails when Ray changes what it relies on).

`own_serve_request_id()` gives the calling task a Serve request id of its own: Serve indexes a
custom request router's pending calls by the HTTP request's id, so concurrent calls made for one
HTTP request (each of its jobs' admissions and submissions, a stream channel opened while serving
it) collide: all but one are never routed and their routing task spins. Each task that calls a
deployment for a request takes an id of its own, in its own context variables. Serve's public API
has no way to do this (`ray.serve.context._set_request_context` is private).
"""

from __future__ import annotations

import uuid


def own_serve_request_id() -> None:
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=uuid.uuid4().hex)


def rpc_options(grpc_transport: bool) -> dict[str, bool]:
    """A handle's options for the request path's calls: with `grpc_transport`, Serve's gRPC
    transport (`_by_reference=False`, an underscored option of `DeploymentHandle.options`), about
    half the CPU a message of the object store's (BENCHMARKS.md, serving over HTTP)."""
    return {"_by_reference": False} if grpc_transport else {}


def joins_running_cluster() -> bool:
    """Whether `serve run` will join a Ray cluster already running (RAY_ADDRESS, or one started on
    this machine by `ray start`), whose Serve settings were fixed when it started: Ray's own
    resolution of the address (`ray._private.services.canonicalize_bootstrap_address`)."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(None) is not None  # type: ignore[arg-type]  # None: resolve it
