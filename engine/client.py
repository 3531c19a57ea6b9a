"""`EngineClient`: the engine as a server sees it. The serve app's replica depends on this
contract alone (cf. Ray Serve LLM's engine protocol); `engine.AsyncEngine` implements it, and the
serve tests' fake engine does too. Torch-free, so the serve app imports it without a model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.config import EngineConfig
from engine.drafts import DraftTransportFactory
from engine.metrics import EngineStats, ModelReport
from engine.outputs import RequestOutput
from engine.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EngineClient(ABC):
    """- `generate` yields RequestOutput DELTAS (per changed sample index, only the new tokens and
      text); the last has `finished=True`. Input the engine refuses raises InvalidRequestError
      (its `param` names the field) on the first iteration, before anything is yielded; a
      request that fails while running raises RequestFailedError; an engine whose step loop
      died raises EngineDeadError. Leaving the iteration early aborts the request.
    - `abort` frees the request's KV blocks at once; unknown ids are ignored.
    - `stats` is the snapshot taken after the latest step (cheap); a request the engine has
      been handed since counts as waiting.
    - `has_request` is True from when `generate` has handed the request to the engine until
      its stream ends: from then on `stats` counts it, so a load report may list it.
    - `is_ready` is False while the engine cannot take requests (its step loop restarting);
      `check_health` raises EngineDeadError once it never will again.
    """

    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, engine_process: bool = False,
                    draft_transport: DraftTransportFactory | None = None, output_interval_s: float = 0.0
                    ) -> EngineClient:
        """`output_interval_s`: deltas may be held and delivered together at most this often
        (a request's first and last ones never are)."""

    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """A transformers tokenizer (encode, decode, apply_chat_template); picklable."""

    @property
    @abstractmethod
    def chat_format(self) -> ChatOutputFormat:
        """How the model writes reasoning and tool calls (engine.chat_output): from its chat
        template and the engine arguments reasoning_parser and tool_call_parser."""

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """The size of the model's embeddings."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    @abstractmethod
    def model_report(self) -> ModelReport:
        """How the model computes (quantization, dtype, quality figures), fixed at start-up."""

    @property
    @abstractmethod
    def block_size(self) -> int: ...

    @property
    @abstractmethod
    def is_ready(self) -> bool: ...

    @abstractmethod
    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0,
                 waited_s: float = 0.0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """`lora`: the LoRA adapter the request runs with (AdapterNotFoundError where none has it)."""

    @abstractmethod
    async def embed(self, prompt_token_ids: list[int], params: PoolingParams, request_id: str, priority: int = 0,
                    waited_s: float = 0.0, lora: str | None = None) -> RequestOutput:
        """An embedding (engine.sampling_params.PoolingParams), scheduled with the same priority
        and aging as generation: the one finished output, its `embedding` set. Raises as
        `generate` does; cancelling the call aborts it."""

    @abstractmethod
    def beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams, request_id: str,
                    priority: int = 0, waited_s: float = 0.0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Beam search (engine.beam_search) as transformers' generate(num_beams=...,
        do_sample=False): yields the finished beams once, best first, as one RequestOutput with
        an output per beam. Errors as `generate`'s; leaving early aborts the search."""

    @abstractmethod
    def load_adapter(self, name: str, path: str) -> None:
        """Serves the LoRA adapter at `path` as `name` from now on (InvalidRequestError where LoRA
        is off, the name is taken or the path holds no adapter)."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def has_request(self, request_id: str) -> bool: ...

    @abstractmethod
    def check_health(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
