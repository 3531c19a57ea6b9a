"""Turns sampled tokens into user outputs: incremental detokenization, stop strings, deltas.

Owns per-request output state (text so far, what was already emitted); tells the engine which
requests a stop string ended, and which failed to detokenize (those fail alone). A step's deltas
can be held: a running request's changes then wait here, and go out with its first tokens, its
end, or the next step that emits every request's (one delta for all the steps held). Text never
includes a stop string or a stop token; while a request
runs, the last (longest stop string - 1) characters are held back, so a stream never shows the
start of a stop string that is later cut. While a step holds, a running sample that has no stop
string to look for and no logprobs to keep is not detokenized: its request's new tokens are read
when its delta goes out (or it ends, or is aborted), the same text from the same tokens in one
pass instead of a call each step. A request with best_of > n emits once, when its
samples are done: the n with the highest cumulative logprob, as choices 0..n-1.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from engine.errors import RequestFailedError
from engine.outputs import CompletionOutput, RequestError, RequestMetrics, RequestOutput, SpecCounts
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.scheduler import SchedulerUpdate


@dataclass(slots=True)
class _SampleState:
    decoder: DecodeStream
    spec: SpecCounts  # its request's, kept up to date by the scheduler
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    finish_emitted: bool = False


@dataclass(slots=True)
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    holdback: int  # characters a running sample's text holds back: the longest stop string's but one
    deferrable: bool  # its text is needed only when a delta goes out: no stop string, no logprobs
    samples: dict[int, _SampleState] = field(default_factory=dict)
    behind: dict[int, Request] = field(default_factory=dict)  # samples with tokens not appended yet, by index
    emitted: bool = False  # an output of it went out
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked, until emitted
    embedding: list[float] | None = None  # an embedding request's, once its prompt is computed


class OutputProcessor:
    def __init__(self, tokenizer, clock: Callable[[], float] = time.monotonic):
        self.tokenizer = tokenizer.backend_tokenizer
        self.states: dict[str, _RequestState] = {}
        self._held: dict[str, _RequestState] = {}  # requests changed since their last output, by group id
        self._clock = clock
        self._wall_offset = time.time() - clock()  # engine timings are on `clock`; outputs show wall time
        # the prompt and its token ids with a request's first output only: set where the outputs go to
        # a client that keeps them from there (engine_core.StepLoop's), so a long prompt is not sent
        # again with every delta
        self.prompt_once = False

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def request_ids(self) -> list[str]:
        return list(self.states)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        self.states[request_id] = _RequestState(prompt, prompt_token_ids, params,
                                                RequestMetrics(arrival_time + self._wall_offset),
                                                max(map(len, params.stop), default=1) - 1,
                                                not params.stop and not params.keeps_logprobs)

    def process(self, update: SchedulerUpdate, logprobs: dict[str, list[dict[int, float]]], hold: bool = False
                ) -> tuple[list[RequestOutput | RequestError], list[str], list[str]]:
        """Returns the step's events (one delta per user request that changed, one error per
        user request that failed), the ids of the requests a stop string just ended, and the
        groups whose detokenization failed (the caller finishes both in the scheduler). `hold`:
        deltas only for the requests whose first output or end this is; the others' wait for a
        step that does not hold."""
        events: list[RequestOutput | RequestError] = []
        for group_id, error in update.failed.items():
            self._held.pop(group_id, None)
            if self.states.pop(group_id, None) is not None:
                events.append(failure_event(group_id, error))
        stopped, failed, changed = [], [], {}
        for request in update.updated:
            state = self.states.get(request.group_id)
            if state is None:
                continue  # its group failed this step
            if (hold and state.deferrable and state.emitted and request.status is RequestStatus.RUNNING
                    and request.sample_index in state.samples):  # read when its delta goes out
                state.behind[request.sample_index] = request
                self._held[request.group_id] = state
                continue
            try:
                sample = state.samples.get(request.sample_index)
                if sample is None:
                    sample = state.samples[request.sample_index] = _SampleState(
                        DecodeStream(skip_special_tokens=state.params.skip_special_tokens), request.spec)
                if state.metrics.first_token_time is None:
                    self._first_token(state, request)
                if state.behind:
                    state.behind.pop(request.sample_index, None)
                if request.embedding is not None:  # an embedding request: done, no tokens
                    state.embedding, sample.finish_reason = request.embedding, _reason(request)
                elif self._append(sample, request, logprobs.get(request.request_id) if logprobs else None,
                                  request.is_finished):
                    stopped.append(request.request_id)
                changed[request.group_id] = state
            except Exception as e:  # detokenizing this request failed: it fails alone
                changed.pop(request.group_id, None)
                events.append(self._fail(request.group_id, e))
                failed.append(request.group_id)
        self._held.update(changed)
        if hold:  # of those this step changed
            due = [(group_id, state) for group_id, state in changed.items() if not state.emitted or _finished(state)]
        else:
            due = list(self._held.items())
        for group_id, state in due:
            try:
                self._catch_up(state)
            except Exception as e:  # detokenizing what it held failed: it fails alone
                events.append(self._fail(group_id, e))
                failed.append(group_id)
                continue
            events.append(self._emit(group_id, state))
        return events, stopped, failed

    def refuse(self, request_id: str, error: Exception) -> RequestError:
        """Drops a request refused before it ran (its constraint did not compile): the error as is."""
        del self.states[request_id]
        return RequestError(request_id, error)

    def abort(self, request_id: str) -> RequestOutput | RequestError | None:
        """Final output of an aborted request: every unfinished sample ends with "abort" (its
        error if its tokens held back fail to detokenize)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        try:
            self._catch_up(state)
        except Exception as e:
            return self._fail(request_id, e)
        for index in range(state.params.num_samples):
            sample = state.samples.setdefault(index, _SampleState(
                DecodeStream(skip_special_tokens=state.params.skip_special_tokens), SpecCounts()))
            sample.finish_reason = sample.finish_reason or FinishReason.ABORT.value
        state.metrics.finished_time = self._clock() + self._wall_offset
        return self._emit(request_id, state)

    def _fail(self, group_id: str, error: Exception) -> RequestError:
        """Drops a request whose detokenization failed: it fails alone."""
        del self.states[group_id]
        self._held.pop(group_id, None)
        return failure_event(group_id, error)

    def _catch_up(self, state: _RequestState) -> None:
        """Appends the tokens of the samples that holding steps left behind (running then)."""
        if state.behind:
            for index, request in state.behind.items():
                self._append(state.samples[index], request, None, False)
            state.behind.clear()

    def _append(self, sample: _SampleState, request: Request, logprobs: list[dict[int, float]] | None,
                ends: bool) -> bool:
        """Adds the request's new tokens (one, several after accepted drafts, or those of steps
        that held) to its sample, in order, the last one ending it where `ends`; True if a stop
        string ended it (the tokens after that one are dropped)."""
        new = request.token_ids[len(request.prompt_token_ids) + len(sample.token_ids):]  # not a copy of every output
        if logprobs is None and not request.params.stop:  # no stop string to look for: decoded in one pass
            running = new[:-1] if ends else new
            sample.token_ids += running
            step, tokenizer = sample.decoder.step, self.tokenizer
            sample.text += "".join([step(tokenizer, token_id) or "" for token_id in running])
            if ends and new:  # the last token ends it: the text decoded whole, a stop token left out
                self._append_token(sample, request, new[-1], None, True)
            return False
        last = len(new) - 1 if ends else -1
        for i, token_id in enumerate(new):
            if self._append_token(sample, request, token_id, logprobs[i] if logprobs else None, i == last):
                return True
        return False

    def _append_token(self, sample: _SampleState, request: Request, token_id: int,
                      logprobs: dict[int, float] | None, finished: bool) -> bool:
        sample.token_ids.append(token_id)
        if logprobs is not None:
            sample.logprobs.append(logprobs)
        if finished:
            sample.finish_reason = _reason(request)
        previous_len = len(sample.text)
        if finished:  # flush bytes the stream decoder still holds; a stop token is not text
            text_ids = sample.token_ids[:-1] if request.ended_on_stop_token else sample.token_ids
            sample.text = self.tokenizer.decode(text_ids, skip_special_tokens=request.params.skip_special_tokens)
        else:
            sample.text += sample.decoder.step(self.tokenizer, token_id) or ""
        stops = request.params.stop
        if not stops or len(sample.token_ids) < request.params.min_tokens:  # nothing ends it before min_tokens
            return False
        search_from = max(0, previous_len - max(map(len, stops)) + 1)
        hits = [(i, s) for s in stops if (i := sample.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, sample.stop_string = min(hits)
        sample.text = sample.text[:at + len(sample.stop_string) * request.params.include_stop_str_in_output]
        was_running = sample.finish_reason is None
        sample.finish_reason = FinishReason.STOP.value
        return was_running

    def _first_token(self, state: _RequestState, request: Request) -> None:
        """Records what the request's first output shows once: its timings, cached tokens, prompt logprobs."""
        metrics = state.metrics
        if request.first_token_time is not None:
            metrics.first_token_time = request.first_token_time + self._wall_offset
            if request.first_scheduled_time is not None:
                metrics.first_scheduled_time = request.first_scheduled_time + self._wall_offset
            state.num_cached_tokens = request.num_cached_prompt_tokens
            state.prompt_logprobs = request.prompt_logprobs

    def _emit(self, request_id: str, state: _RequestState) -> RequestOutput:
        params, samples = state.params, state.samples
        finished = _finished(state)
        prompt, prompt_token_ids = (state.prompt, state.prompt_token_ids) if not (state.emitted and self.prompt_once) \
            else (None, [])
        state.emitted = True
        self._held.pop(request_id, None)
        deltas = []
        for index, sample in self._returned(state, finished):
            text = sample.text
            end = len(text) if sample.finish_reason else max(sample.num_emitted_chars, len(text) - state.holdback)
            text, tokens = text[sample.num_emitted_chars:end], sample.token_ids[sample.num_emitted_tokens:]
            if not text and not tokens and (sample.finish_reason is None or sample.finish_emitted):
                continue
            sample.finish_emitted = sample.finish_reason is not None
            deltas.append(CompletionOutput(index, text, tokens, sample.finish_reason,
                                           sample.logprobs[sample.num_emitted_tokens:]
                                           if params.logprobs is not None else None, sample.stop_string))
            sample.num_emitted_chars, sample.num_emitted_tokens = end, len(sample.token_ids)
        # one sample's counts are its request's own, kept up to date by the scheduler: no sum to make
        state.metrics.spec = (next(iter(samples.values())).spec if len(samples) == 1
                              else sum((s.spec for s in samples.values()), SpecCounts()))
        if finished:
            del self.states[request_id]
            state.metrics.finished_time = state.metrics.finished_time or self._clock() + self._wall_offset
        output = RequestOutput(request_id, prompt, prompt_token_ids, deltas, finished,
                               state.metrics, state.num_cached_tokens, state.prompt_logprobs, state.embedding)
        state.prompt_logprobs = None  # sent once, with the first output
        return output

    @staticmethod
    def _returned(state: _RequestState, finished: bool) -> Iterable[tuple[int, _SampleState]]:
        """(choice index, sample) of what the request returns: every sample as it goes, or with
        best_of > n, once all are done, the n highest by cumulative logprob."""
        if not state.params.ranks_samples:
            return sorted(state.samples.items()) if len(state.samples) > 1 else state.samples.items()
        if not finished:
            return []
        best = sorted(state.samples.values(), key=_cumulative_logprob, reverse=True)[:state.params.n]
        return list(enumerate(best))


def _finished(state: _RequestState) -> bool:
    """Every sample of the request has ended."""
    samples = state.samples
    return len(samples) == state.params.num_samples and all(s.finish_reason is not None for s in samples.values())


def _cumulative_logprob(sample: _SampleState) -> float:
    return sum(entry[token] for token, entry in zip(sample.token_ids, sample.logprobs))


def failure_event(group_id: str, error: Exception) -> RequestError:
    return RequestError(group_id, RequestFailedError(f"request failed: {type(error).__name__}: {error}"))


def _reason(request: Request) -> str:
    """A finished request's finish reason, as outputs spell it."""
    if request.finish_reason is None:
        raise ValueError(f"request {request.request_id} has no finish reason")
    return request.finish_reason.value
