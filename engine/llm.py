"""Offline batch API, vLLM-compatible: `LLM(...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import dataclasses
import itertools

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestError, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tools import forced_calls, parse_tools, resolve_tool_choice

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine.from_engine_args(model, **engine_args)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order. A str or a list of ints is one
        prompt. Raises ValueError (adding nothing) if any prompt or parameter is invalid."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        params = sampling_params
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return self._run(self._add(prompts, params, priority or [0] * len(prompts)), use_tqdm)

    def _add(self, prompts: list[Prompt], params: list[SamplingParams | BeamSearchParams], priorities: list[int]
             ) -> list[str]:
        """Adds every request, or (ValueError) none."""
        request_ids = [str(next(self._ids)) for _ in prompts]
        for i, (request_id, prompt, p) in enumerate(zip(request_ids, prompts, params)):
            try:
                self.engine.add_request(request_id, prompt, p, priorities[i])
            except ValueError:
                for added in request_ids[:i]:
                    self.engine.abort_request(added)
                raise
        return request_ids

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation (OpenAI-format messages, tool
        calls and results included), then generates. `tools`, `tool_choice`: as OpenAI's; a
        `required` or named choice constrains the output to calls whose arguments validate.
        `engine.tools.parse_tool_calls` reads the calls out of an output's text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        offered = parse_tools(tools)
        params = sampling_params or SamplingParams()
        forced = forced_calls(offered, resolve_tool_choice(tool_choice, offered), parallel_tool_calls)
        if forced is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError("tool_choice", "a required or named tool_choice constrains the output; "
                                                         "it cannot be given with structured_outputs")
            params = dataclasses.replace(params, structured_outputs=forced)
        return self.generate([self.engine.encode_chat(c, offered) for c in conversations], params, use_tqdm)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, use_tqdm: bool = False
                    ) -> list[RequestOutput]:
        """Beam search as transformers' generate(num_beams=params.beam_width, do_sample=False):
        per prompt, its beam_width finished beams best first (engine.beam_search.BeamOutput: the
        tokens, text, cumulative logprob and ranking score). Every prompt's beams step in the
        engine's batches (engine.beam_groups)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(self._add(prompts, [params] * len(prompts), [0] * len(prompts)), use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps until every request ends. A request that failed raises its error once the
        others are done (their outputs are not returned then)."""
        results: dict[str, RequestOutput] = {}
        errors: list[RequestError] = []
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, unit="req")
        num_tokens = 0
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if isinstance(delta, RequestError):
                    errors.append(delta)
                    continue
                num_tokens += sum(len(o.token_ids) for o in delta.outputs)
                if delta.request_id in results:
                    results[delta.request_id].merge(delta)
                else:  # a beam search's one output is whole already, and keeps its beams' scores
                    results[delta.request_id] = delta if delta.finished else _cumulative(delta)
                if delta.finished:
                    bar.update(1)
                    bar.set_postfix_str(f"output {num_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
        bar.close()
        if errors:
            if isinstance(errors[0].error, InvalidRequestError):  # refused before it ran (its constraint)
                raise errors[0].error
            raise RuntimeError(f"{len(errors)} request(s) failed, first {errors[0].request_id!r}: "
                               f"{errors[0].error}") from errors[0].error
        return [results[i] for i in request_ids]


def _cumulative(first: RequestOutput) -> RequestOutput:
    result = RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, [], False, first.metrics)
    result.merge(first)
    return result
