"""Errors the engine reports to its callers, with what a server needs to answer them as data.

Torch-free: the serve app imports it to map engine errors to HTTP answers.
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Input the engine refuses; `param` names the offending field and `code` the rule, as an
    OpenAI error body has them."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code

    def __reduce__(self):  # pickles across process boundaries with its fields
        return type(self), (self.param, self.message, self.code)


class AdapterNotFoundError(InvalidRequestError):
    """A LoRA adapter no lora_modules entry, run-time load or adapter_dirs entry names: a 404."""


class RequestFailedError(RuntimeError):
    """A request the engine accepted failed while running (its own fault, or the engine's);
    its batch-mates and the engine go on."""


class EngineDeadError(RuntimeError):
    """The engine's step loop is gone; the request cannot run on it."""


class UnsupportedModelError(ValueError):
    """A checkpoint the engine cannot serve (no native family, and its modeling code cannot take
    the paged attention), said at load time with the reason."""
