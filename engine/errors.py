"""Errors the engine reports to its callers, with what a server needs to answer them as data.

Torch-free: the serve app imports it to map engine errors to HTTP answers.
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Input the engine refuses; `param` names the offending field (an OpenAI error's `param`)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self):  # pickles across the step-loop process boundary with its param
        return type(self), (self.param, self.message)


class RequestFailedError(RuntimeError):
    """A request the engine accepted failed while running (its own fault, or the engine's);
    its batch-mates and the engine go on."""


class EngineDeadError(RuntimeError):
    """The engine's step loop is gone; the request cannot run on it."""
