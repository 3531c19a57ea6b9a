"""The engine's running beam searches, each a group of scheduler requests, one per running beam.

A beam computes its last token and samples its next token's top-K logprobs; the scheduler then
parks it, holding its blocks. Once every beam of the search's step has sampled, the search
(engine.beam_search.BeamSearch) picks the next beams, and each is forked from the parked beam it
extends (Scheduler.fork_beam): it shares that beam's blocks, full ones by reference and the last,
partial one copy-on-write, so a step computes one token per beam. Then the parked beams end. A
search's stream gets one output, when it is done: the finished beams, best first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.output_processor import failure_event
from engine.outputs import RequestError, RequestOutput
from engine.request import FinishReason, Request
from engine.scheduler.scheduler import Scheduler, SchedulerUpdate

if TYPE_CHECKING:
    from engine.lora import Adapter


@dataclass(slots=True)
class _Group:
    search: BeamSearch
    beam_ids: list[str]  # the scheduler requests of the running beams, in the search's order
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)  # this step's, by beam
    num_steps: int = 0


class BeamGroups:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._groups: dict[str, _Group] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def request_ids(self) -> list[str]:
        return list(self._groups)

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams, priority: int,
            arrival_time: float, adapter: Adapter | None = None) -> None:
        """Starts a search (its beams with `adapter`, a LoRA adapter installed); raises
        InvalidRequestError (beam_width) or ValueError (it could never fit), changing nothing."""
        search = BeamSearch(prompt_token_ids, params, self.eos_token_ids, self.max_model_len)
        self.scheduler.check_fits(len(prompt_token_ids), search.max_tokens)
        first = Request(f"{request_id}#beam0.0", prompt_token_ids, search.step_params(), group_id=request_id,
                        priority=priority, arrival_time=arrival_time, beam=True, adapter=adapter)
        self.scheduler.add_request(first)
        self._groups[request_id] = _Group(search, [first.request_id])

    def process(self, update: SchedulerUpdate, logprobs: dict[str, list[dict[int, float]]]
                ) -> list[RequestOutput | RequestError]:
        """Advances the searches whose beams have all sampled; the outputs of those done, and an
        error for each search whose group failed this step."""
        if not self._groups:  # every step calls this: nothing to look at without a search
            return []
        events: list[RequestOutput | RequestError] = []
        for group_id, error in update.failed.items():
            if self._groups.pop(group_id, None) is not None:
                events.append(failure_event(group_id, error))
        advanced = []
        for request in update.updated:
            group = self._groups.get(request.group_id)
            if group is not None:
                group.logprobs[request.request_id] = logprobs[request.request_id][-1]
                if len(group.logprobs) == len(group.beam_ids):
                    advanced.append(request.group_id)
        for group_id in advanced:
            events += self._advance(group_id, self._groups[group_id])
        return events

    def _advance(self, group_id: str, group: _Group) -> list[RequestOutput]:
        search = group.search
        search.advance([group.logprobs[beam_id] for beam_id in group.beam_ids])
        if search.done:
            del self._groups[group_id]
            self.scheduler.finish_group(group_id, FinishReason.LENGTH)
            return [search.output(group_id, self.tokenizer)]
        group.num_steps += 1
        parents, group.beam_ids, group.logprobs = group.beam_ids, [], {}
        for i, (parent, beam) in enumerate(zip(search.parents, search.running)):
            beam_id = f"{group_id}#beam{group.num_steps}.{i}"
            self.scheduler.fork_beam(parents[parent], beam_id, beam.token_ids[-1])
            group.beam_ids.append(beam_id)
        for parent_id in parents:
            self.scheduler.finish_request(parent_id, FinishReason.LENGTH)
        return []

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted search (no beams); None if unknown. The caller ends
        its requests in the scheduler."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        return RequestOutput(request_id, None, group.search.prompt_token_ids, [], True, group.search.metrics)
