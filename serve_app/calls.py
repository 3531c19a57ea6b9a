"""The deployments the request path calls by handle, as the typed interfaces it calls them through.

Ray's DeploymentHandle types every call's result as a response or a response generator, whichever
the call is; these protocols say which each call is and what it carries, so the type checker holds
the callers to them. A DeploymentHandle is what is passed where they are asked (the test suite's
stand-ins fit them too: tests/serve/handles.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, overload

if TYPE_CHECKING:
    from serve_app.messages import Abort, AdmitRequest, AdmitResult, Batch, ModelInfo, Open, Submit

T = TypeVar("T", covariant=True)
A = TypeVar("A", contravariant=True)


class Call(Protocol[A, T]):
    """A unary call taking `A`: its result, awaited."""

    def remote(self, argument: A, /) -> Awaitable[T]: ...


class Query(Protocol[T]):
    """A unary call taking nothing."""

    def remote(self) -> Awaitable[T]: ...


class Stream(Protocol[T]):
    """A streamed call's items; `cancel` ends it at the callee."""

    def __aiter__(self) -> AsyncIterator[T]: ...

    def __anext__(self) -> Awaitable[T]: ...

    def cancel(self) -> None: ...


class StreamCall(Protocol[A, T]):
    def remote(self, argument: A, /) -> Stream[T]: ...


class RouterStreams(Protocol):
    @property
    def admit_many(self) -> StreamCall[list[AdmitRequest], list[tuple[str, AdmitResult]]]: ...


class RouterHandle(Protocol):
    """The Router deployment (serve_app.router.Router)."""

    @property
    def release(self) -> Call[list[str], None]: ...

    @property
    def remove_replica(self) -> Call[str, None]: ...

    @property
    def ready_replicas(self) -> Query[dict[str, int]]: ...

    @overload
    def options(self, *, stream: Literal[True]) -> RouterStreams: ...

    @overload
    def options(self, *, _by_reference: bool) -> RouterHandle: ...  # the transport (serve_internals.rpc_options)


class ReplicaStreams(Protocol):
    @property
    def channel(self) -> StreamCall[Open, str | Batch]: ...


class ReplicaHandle(Protocol):
    """An engine model's EngineReplica deployment (serve_app.replica.EngineReplica)."""

    @property
    def submit(self) -> Call[Submit, bool]: ...

    @property
    def abort(self) -> Call[Abort, None]: ...

    @property
    def model_info(self) -> Query[ModelInfo]: ...

    @overload
    def options(self, *, stream: Literal[True]) -> ReplicaStreams: ...

    @overload
    def options(self, *, _by_reference: bool) -> ReplicaHandle: ...
