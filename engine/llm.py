"""Offline batch API, vLLM-compatible: `LLM(...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestError, RequestOutput
from engine.sampling_params import PoolingParams, SamplingParams
from engine.tokenization import encode_text, render_chat
from engine.tools import forced_tools, parse_tools, resolve_tool_choice

Prompt = str | list[int]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A str or a list of ints is one prompt."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine.from_engine_args(model, **engine_args)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order. A str or a list of ints is one
        prompt. `lora`: the LoRA adapter every prompt (or each) runs with. Raises ValueError
        (adding nothing) if any prompt or parameter is invalid."""
        prompts = _prompt_list(prompts)
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        return self._run(self._add(prompts, params, priority or [0] * len(prompts), loras), use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`, engine.sampling_params.PoolingParams),
        computed in the same steps as any generation; outputs in input order."""
        prompts = _prompt_list(prompts)
        params = [pooling_params or PoolingParams()] * len(prompts)
        return self._run(self._add(prompts, params, priority or [0] * len(prompts)), use_tqdm)

    def _add(self, prompts: list[Prompt], params: Sequence[SamplingParams | BeamSearchParams | PoolingParams],
             priorities: list[int], loras: list[str | None] | None = None) -> list[str]:
        """Adds every request, or (ValueError) none."""
        request_ids = [str(next(self._ids)) for _ in prompts]
        for i, (request_id, prompt, p) in enumerate(zip(request_ids, prompts, params)):
            try:
                self.engine.add_request(request_id, prompt, p, priorities[i], lora=loras[i] if loras else None)
            except ValueError:
                for added in request_ids[:i]:
                    self.engine.abort_request(added)
                raise
        return request_ids

    @property
    def chat_format(self) -> ChatOutputFormat:
        """How the model writes reasoning and tool calls: `chat_format.parse(prompt_text, text,
        calls=True)` splits an output of `chat` into them."""
        return self.engine.chat_format

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation (OpenAI-format messages, tool
        calls and results included; `chat_template_kwargs` such as `enable_thinking` reach the
        template), then generates. `tools`, `tool_choice`: as OpenAI's; a `required` or named
        choice constrains the output to calls in the model's own format whose arguments validate;
        a structured output constrains the answer after any reasoning (`chat_format`)."""
        conversations = (cast(list[list[dict]], [messages]) if messages and isinstance(messages[0], dict)
                         else cast(list[list[dict]], messages))
        offered = parse_tools(tools)
        choice = resolve_tool_choice(tool_choice, offered)
        forced = forced_tools(offered, choice, parallel_tool_calls)
        base = sampling_params or SamplingParams()
        prompts: list[Prompt] = []
        params: list[SamplingParams] = []
        for conversation in conversations:
            text = render_chat(self.tokenizer, conversation, True, offered, chat_template_kwargs)
            prompts.append(encode_text(self.tokenizer, text, add_special_tokens=False, param="messages"))
            params.append(self.chat_format.sampling_params(base, text, forced, calls=choice != "none"))
        return self.generate(prompts, params, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
                    ) -> list[RequestOutput]:
        """Beam search as transformers' generate(num_beams=params.beam_width, do_sample=False):
        per prompt, its beam_width finished beams best first (engine.beam_search.BeamOutput: the
        tokens, text, cumulative logprob and ranking score). Every prompt's beams step in the
        engine's batches (engine.beam_groups)."""
        prompts = _prompt_list(prompts)
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
