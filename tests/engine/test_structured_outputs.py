"""Structured outputs through the engine's real paths: every output matches its constraint (a
JSON schema validated by jsonschema, a regex, a choice, a Lark or GBNF grammar), sampled or
greedy, n > 1, in one batch with free requests (which are not changed by them), under
preemption and speculative decoding (drafts the constraint rejects are never accepted: the
greedy tokens equal those without drafts), or ends with "length". A constraint that does not
compile refuses its request alone; compiling runs beside the step loop and once per constraint."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.outputs import RequestError
from engine.sampling_params import StructuredOutputsParams
from tests.engine.helpers import save_first_layer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
PROMPTS = ["the cat sat on a mat", "dogs ran fast over green hills", "stars as people sang songs about old ships"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    "lark": StructuredOutputsParams(grammar='start: "(" num (" + " num)* ")"\nnum: /[0-9]{1,2}/'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "(" num (" + " num)* ")"\nnum ::= [0-9] [0-9]?'),
}


def matches(kind: str, text: str) -> bool:
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and (kind == "json_object" or jsonschema.Draft202012Validator(SCHEMA)
                                            .is_valid(value))
    if kind == "regex":
        return re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe so")
    return re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2})*\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, max_num_seqs=64)


def constrained(kind: str, **params) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 160, "structured_outputs": CONSTRAINTS[kind]} | params)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_output_matches_its_constraint_greedy_and_sampled_with_n(llm, kind):
    greedy = llm.generate(PROMPTS, constrained(kind, temperature=0), use_tqdm=False)
    sampled = llm.generate(PROMPTS, constrained(kind, temperature=1.0, n=3, seed=7), use_tqdm=False)
    choices = [c for o in greedy + sampled for c in o.outputs]
    assert len(choices) == 3 + 9
    for i, c in enumerate(choices):
        unbounded = kind == "json_object" and i >= 3  # a random model's free-form object may run out of tokens
        assert (c.finish_reason == "stop" and matches(kind, c.text)) or (unbounded and c.finish_reason == "length"), \
            (c.text, c.finish_reason)
    if kind == "json":
        assert len({c.text for c in choices}) > 3  # sampled samples differ: the constraint is not one string


def test_constrained_and_free_requests_share_a_batch_and_the_free_ones_are_unchanged(llm):
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    kinds = [k for k in CONSTRAINTS if k != "json_object"]  # bounded constraints: each ends within max_tokens
    params = [free] * len(PROMPTS) + [constrained(k, temperature=0) for k in kinds]
    outputs = llm.generate(PROMPTS + ["the cat"] * len(kinds), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:len(PROMPTS)]] == alone
    for kind, output in zip(kinds, outputs[len(PROMPTS):]):
        assert matches(kind, output.outputs[0].text), (kind, output.outputs[0].text)


def test_a_constrained_output_cut_by_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPTS[0], constrained("json", max_tokens=5, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and not matches("json", out.text)


@pytest.mark.parametrize("engine_args", [
    dict(num_blocks=48, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_blocks=48, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"),
], ids=["preempt-swap", "preempt-recompute"])
def test_preempted_constrained_requests_give_the_tokens_they_give_unpreempted(llm, tiny_llama, engine_args):
    params = [constrained(k, temperature=0) for k in ("json", "lark", "regex")] * 2
    prompts = PROMPTS * 2
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama, **engine_args)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = tight.engine.get_stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    tight.engine.kv.check_integrity()
    assert tight.engine.kv.num_free_blocks == tight.engine.kv.num_blocks


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama, tmp_path_factory) -> str:
    return save_first_layer(tiny_llama, tmp_path_factory.mktemp("tiny-draft"))


@pytest.mark.parametrize("method", ["ngram", "self_draft", "draft_model"])
def test_drafts_the_constraint_rejects_are_never_accepted(llm, tiny_llama, tiny_draft, method):
    """Greedy constrained tokens with drafts equal those without; drafts were proposed and some
    rejected (the prompts repeat JSON the schema forbids, so n-gram drafts often break it)."""
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 3, "adaptive": False},
            "self_draft": {"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 3, "adaptive": False},
            "draft_model": {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3,
                            "adaptive": False}}[method]
    prompts = ['{"name": "abc", "age": 5, "role": "root", "tags": ["a"], "name": "abc", "age": 5, "role": "root"'] * 2 \
        + PROMPTS
    params = [constrained(k, temperature=0) for k in ("json", "json", "lark", "regex", "choice")]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    speculative = LLM(tiny_llama, speculative_config=spec)
    outputs = speculative.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for kind, output in zip(("json", "json", "lark", "regex", "choice"), outputs):
        assert matches(kind, output.outputs[0].text)
    stats = speculative.engine.get_stats()
    assert 0 <= stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens


def test_sampled_constrained_outputs_under_speculation_match_their_constraint(tiny_llama):
    speculative = LLM(tiny_llama, speculative_config={"method": "self_draft", "num_layers": 1,
                                                      "num_speculative_tokens": 3, "adaptive": False})
    outputs = speculative.generate(PROMPTS, constrained("json", temperature=1.0, n=2), use_tqdm=False)
    for c in (c for o in outputs for c in o.outputs):
        assert c.finish_reason == "stop" and matches("json", c.text), c.text
    assert speculative.engine.get_stats().num_spec_proposed_tokens > 0


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "invalid JSON schema"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1]), "must be an object"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice must be a non-empty list"),
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
], ids=["bad-schema", "schema-not-json", "schema-not-object", "empty-regex", "empty-choice", "choice-type",
        "none", "two"])
def test_a_malformed_constraint_is_refused_naming_it(spec, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        StructuredOutputsParams(**spec)
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(regex="(?<=a)b"), "look-around"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(?=x)"}), "look-around"),
], ids=["regex", "grammar", "schema-pattern"])
def test_a_constraint_the_grammar_engine_cannot_compile_refuses_its_request_alone(llm, tiny_llama, spec, message):
    engine = LLMEngine.from_engine_args(tiny_llama)
    engine.add_request("bad", "the cat", SamplingParams(max_tokens=8, structured_outputs=spec))
    engine.add_request("good", "the cat", SamplingParams(max_tokens=8, temperature=0))
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    errors = [e for e in events if isinstance(e, RequestError)]
    assert [e.request_id for e in errors] == ["bad"]
    assert isinstance(errors[0].error, InvalidRequestError) and message in str(errors[0].error)
    assert any(e.request_id == "good" and e.finished for e in events if not isinstance(e, RequestError))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    with pytest.raises(InvalidRequestError, match=message):  # offline: the refusal itself
        llm.generate("the cat", SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)


def test_compiling_runs_beside_the_step_loop_and_once_per_constraint(tiny_llama, monkeypatch):
    import engine.grammar as grammar

    release, compiled = threading.Event(), []
    real = grammar.grammar_text

    def slow_grammar_text(spec):
        compiled.append(spec.key)
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(grammar, "grammar_text", slow_grammar_text)
    engine = LLMEngine.from_engine_args(tiny_llama)
    engine.add_request("constrained", "the cat", constrained("json", temperature=0))
    engine.add_request("free", "the cat", SamplingParams(max_tokens=6, temperature=0))
    finished = []
    while "free" not in finished:  # the free request runs to its end while the constraint compiles
        finished += [e.request_id for e in engine.step() if not isinstance(e, RequestError) and e.finished]
    assert "constrained" not in finished and engine.has_unfinished_requests()
    release.set()
    engine.add_request("same", "dogs ran", constrained("json", temperature=0))
    texts, done = {}, set()
    while engine.has_unfinished_requests():
        for event in engine.step():
            assert not isinstance(event, RequestError)
            texts[event.request_id] = texts.get(event.request_id, "") + event.outputs[0].text
            done |= {event.request_id} if event.finished else set()
    assert done == {"constrained", "same"} and all(matches("json", texts[i]) for i in done)
    assert compiled == [CONSTRAINTS["json"].key]  # the second request used the cached compilation


def test_aborting_a_request_while_its_constraint_compiles_ends_it(tiny_llama):
    engine = LLMEngine.from_engine_args(tiny_llama)
    engine.add_request("r", "the cat", constrained("regex"))
    final = engine.abort_request("r")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_a_tokenizer_the_grammar_engine_cannot_read_refuses_constrained_requests_only(tiny_llama_words):
    """The word-level test tokenizer's decoder is one llguidance cannot map to bytes."""
    llm = LLM(tiny_llama_words)
    with pytest.raises(InvalidRequestError, match="not available for this model's tokenizer"):
        llm.generate("the cat", constrained("regex"), use_tqdm=False)
    assert llm.generate("the cat", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
