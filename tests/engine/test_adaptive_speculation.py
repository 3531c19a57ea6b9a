"""Adaptive speculation: how many drafts each request verifies follows its own acceptance and the
measured cost of a step, through the real scheduler (a fake runner accepts or rejects drafts)."""
from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.outputs import ModelRunnerOutput
from engine.request import FinishReason
from engine.scheduler.speculation.adaptive import AdaptiveSpeculation
from engine.scheduler.step_time import StepTimeModel
from tests.engine.helpers import make_request, make_scheduler

K = 4
PROMPT = [1, 2, 3, 4] * 4  # every suffix occurred before: n-gram lookup always has a draft


def _cost_model(fixed: float, per_token: float) -> StepTimeModel:
    model = StepTimeModel()
    for tokens in [1, 4, 9, 16, 30, 64, 17] * 5:  # the plain steps of 1, 4, 16 and 64 decodes among them
        model.observe(tokens, fixed + per_token * tokens)
    return model


def _free_passes(num_requests: int) -> float:
    return 0.0


def _passes_of_30ms(num_requests: int) -> float:
    return 0.030


def test_trim_keeps_drafts_when_tokens_are_nearly_free_and_drops_them_when_they_cost_a_full_share():
    adaptive = AdaptiveSpeculation()
    drafts = [[7, 8, 9, 10]]
    # batch 1 on a CPU: a step is its fixed cost (weights read once); at the prior alpha 0.5 the
    # 4th draft still yields 0.0625 tokens, far above what its 0.5 ms costs in a 50 ms step
    assert adaptive.trim(["a"], drafts, _cost_model(0.050, 0.0005), 1) == drafts
    # a full batch: tokens cost 10 ms each and fixed 10 ms; only a draft nearly sure to pass would pay
    drafts_64 = [[7, 8, 9, 10]] * 64
    assert adaptive.trim([f"r{i}" for i in range(64)], drafts_64, _cost_model(0.010, 0.010), 64) == [[]] * 64
    assert adaptive.trim(["u"], drafts, StepTimeModel(), 1) == drafts  # nothing measured yet: every draft
    assert adaptive.trim(["u"], drafts, _cost_model(0.050, 0.0005), 2) == [[]]  # 2 decodes: plain step first


def test_trim_gives_a_request_that_is_usually_right_more_drafts_than_one_that_is_usually_wrong():
    adaptive = AdaptiveSpeculation()
    for _ in range(10):
        adaptive.observe("good", K, K)  # every draft accepted
        adaptive.observe("bad", K, 0)  # the first draft rejected
    assert adaptive.alpha("good") > 0.9 and adaptive.alpha("bad") < 0.2
    trimmed = adaptive.trim(["good", "bad"], [[5] * K, [6] * K], _cost_model(0.030, 0.005), 4)
    assert trimmed == [[5] * K, []]


def test_trim_prices_each_step_size_by_its_measured_time_not_by_a_line():
    """Measured here on SmolLM2-135M in fp32: one token 50 ms, two 93 ms, five 105 ms (a second
    row turns a matrix-vector product into a slower matrix-matrix one). A request whose drafts are
    seldom right gets none (1.14 tokens in 93 ms is worse than 1 in 50), one whose drafts are
    nearly always right gets all four (4.5 tokens in 105 ms)."""
    model = StepTimeModel()
    for tokens, seconds in [(1, 0.050), (2, 0.093), (3, 0.120), (4, 0.110), (5, 0.105), (64, 0.9), (128, 1.7)] * 3:
        model.observe(tokens, seconds)
    adaptive = AdaptiveSpeculation()
    for _ in range(10):
        adaptive.observe("chat", K, 0)
        adaptive.observe("copy", K, K)
    assert adaptive.trim(["chat"], [[1, 2, 3, 4]], model, 1) == [[]]
    assert adaptive.trim(["copy"], [[1, 2, 3, 4]], model, 1) == [[1, 2, 3, 4]]
    linear = _cost_model(0.050, 0.0005)  # the same machine as a line through its prefills would see it
    assert adaptive.trim(["chat"], [[1, 2, 3, 4]], linear, 1) != [[]]  # which would draft at a loss


def _decode_steps(sched, accept: dict[str, bool], steps: int) -> list[dict[str, int]]:
    """Runs `steps` scheduler steps; a request in `accept` gets all its drafts accepted (True) or
    its first draft rejected (False); other tokens continue the prompt's cycle 1, 2, 3, 4. Returns
    the drafts each request verified per step."""
    history = []
    for _ in range(steps):
        out = sched.schedule()
        sampled, drafts = {}, {}
        for item in out.scheduled:
            if not item.sample:
                continue
            rid, d = item.request.request_id, item.draft_token_ids
            drafts[rid] = len(d)
            if d and accept.get(rid, False):
                sampled[rid] = d + [d[-1] % 4 + 1]
            elif d:
                sampled[rid] = [d[0] % 4 + 1]  # a prompt token other than the draft: rejected
            else:
                sampled[rid] = [item.request.token_ids[-1] % 4 + 1]
        sched.update_from_output(out, ModelRunnerOutput(sampled, {}))
        sched.kv.check_integrity()
        history.append(drafts)
    return history


def test_speculation_stops_in_a_full_batch_and_resumes_when_the_load_falls():
    """1. 16 requests decode, tokens cost a full share of the step: no drafts. 2. 15 finish, the
    machine is the batch-1 CPU one again (fixed cost dominates): the survivor verifies K drafts."""
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_seqs=16, max_num_batched_tokens=256,
                           speculative=SpeculativeConfig(num_speculative_tokens=K))
    requests = [make_request(prompt=PROMPT, max_tokens=200) for _ in range(16)]
    for r in requests:
        sched.add_request(r)
    _decode_steps(sched, {}, 1)  # the prompts
    sched.step_time = _cost_model(0.010, 0.010)
    assert all(d == {r.request_id: 0 for r in requests} for d in _decode_steps(sched, {}, 5))
    for r in requests[1:]:
        sched.finish_request(r.request_id, FinishReason.ABORT)
    sched.step_time = _cost_model(0.050, 0.0005)
    survivor = requests[0].request_id
    assert [d[survivor] for d in _decode_steps(sched, {survivor: True}, 5)] == [K] * 5


def _four_decoding(max_tokens: int):
    """A scheduler with four requests past their prompts, at a load where a draft needs odds of
    about 0.37 (c * N / T = 0.24 for four decodes, 0.37 with K good drafts)."""
    sched = make_scheduler(num_blocks=1024, block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                           speculative=SpeculativeConfig(num_speculative_tokens=K))
    requests = [make_request(prompt=PROMPT, max_tokens=max_tokens) for _ in range(4)]
    for r in requests:
        sched.add_request(r)
    _decode_steps(sched, {}, 1)
    sched.step_time = _cost_model(0.050, 0.004)
    return sched, requests


def test_each_request_gets_the_drafts_its_acceptance_earns_and_a_denied_one_is_retried():
    """Four requests at a load where a draft needs odds of about 0.37: the one whose drafts are
    always accepted keeps verifying K; those whose drafts are always rejected drop to 0 and,
    learning nothing while denied (their estimate drifts back to the prior 0.5), are retried with
    a draft now and then."""
    sched, requests = _four_decoding(max_tokens=400)
    good, bad = requests[0].request_id, requests[1].request_id
    history = _decode_steps(sched, {good: True, bad: False}, 60)
    assert [d[good] for d in history[-20:]] == [K] * 20
    bad_drafts = [d[bad] for d in history[20:]]
    assert bad_drafts.count(0) >= 30  # mostly denied once its record is poor
    assert 2 <= sum(bad_drafts) <= 10  # yet retried now and then
    assert requests[1].spec.accepted == 0 and requests[0].spec.acceptance_rate == 1.0


def test_where_drafts_are_never_right_requests_start_and_return_from_a_lower_prior():
    """The same load with all four requests' drafts always rejected (a draft model that does not
    predict its target): the engine-wide estimate falls, so denied requests drift back to it
    rather than to 0.5 and are retried about every 40 steps instead of every step or two, yet
    still retried; a new request starts from it too."""
    sched, requests = _four_decoding(max_tokens=600)
    history = _decode_steps(sched, {r.request_id: False for r in requests}, 400)
    retried = sum(sum(d.values()) for d in history[40:])
    assert 0 < retried <= 60, retried
    assert sched.adaptive.alpha("new") == sched.adaptive.prior < 0.25


def test_draft_model_passes_are_priced_on_top_of_the_verifying_step():
    """At batch 1, where drafts verify almost free, K drafts pay while no draft model has to run
    for them; with draft passes that cost 60% of a step each (a self-draft on a small model), a
    request right half the time is better off without them, one nearly always right still drafts."""
    adaptive = AdaptiveSpeculation()
    cost = _cost_model(0.050, 0.0005)
    assert adaptive.trim(["a"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_free_passes) == [[7, 8, 9, 10]]
    assert adaptive.trim(["a"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) == [[]]
    for _ in range(10):
        adaptive.observe("sure", K, K)
    assert adaptive.trim(["sure"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) == [[7, 8, 9, 10]]


def test_a_draft_pass_is_priced_by_the_requests_it_drafts_for():
    """Draft passes over 64 requests measured at 60 ms, over 4 at 6 ms. At batch 4, requests a
    draft model is always right for draft, at the small pass's price; priced at the full batch's
    pass (one engine-wide figure did that) they never would, and the small pass, never run again,
    would keep that price."""
    sched = make_scheduler(num_blocks=64, block_size=4,
                           speculative=SpeculativeConfig(method="self_draft", num_speculative_tokens=K))
    for _ in range(4):
        sched.observe_step(0, 0.0, K, K * 0.060, 64)
        sched.observe_step(0, 0.0, K, K * 0.006, 4)
    assert sched.draft_pass_seconds(64) == pytest.approx(0.060) and sched.draft_pass_seconds(4) == pytest.approx(0.006)
    assert 0.006 < sched.draft_pass_seconds(16) < 0.060  # a size not timed yet: the fitted line
    adaptive, ids = AdaptiveSpeculation(prior_from_engine=True), [f"r{i}" for i in range(4)]
    for request_id in ids:
        for _ in range(10):
            adaptive.observe(request_id, K, K)
    cost = _cost_model(0.050, 0.0005)
    assert adaptive.trim(ids, [[7, 8, 9, 10]] * 4, cost, 4, sched.draft_pass_seconds) == [[7, 8, 9, 10]] * 4
    assert adaptive.trim(ids, [[7, 8, 9, 10]] * 4, cost, 4, lambda n: sched.draft_pass_seconds(64)) == [[]] * 4


def test_a_new_request_starts_from_what_a_draft_models_drafts_have_earned():
    """Draft passes at 60% of a step, batch 1: at the 0.5 a fresh engine starts from, a draft does
    not pay. 1. Where earlier requests' drafts were all accepted (a draft model that predicts any
    text), a new request drafts from its first step, and still does after many steps in which no
    draft paid (a full batch, where the draft passes cost more than sure drafts save). 2. Its own
    rejections soon take that back. 3. N-gram drafts, whose acceptance is each text's own, give a
    new request no such start."""
    cost, full_batch = _cost_model(0.050, 0.0005), _cost_model(0.010, 0.010)
    assert AdaptiveSpeculation(True).trim(["first"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) == [[]]
    model, ngram = AdaptiveSpeculation(prior_from_engine=True), AdaptiveSpeculation(prior_from_engine=False)
    for adaptive in (model, ngram):
        for i in range(10):
            adaptive.observe(f"earlier{i}", K, K)
            adaptive.forget(f"earlier{i}")
        ids = [f"busy{i}" for i in range(16)]
        for _ in range(200):
            assert adaptive.trim(ids, [[3]] * 16, full_batch, 16, pass_seconds=_passes_of_30ms) == [[]] * 16
    assert ngram.prior == ngram.alpha("new") == 0.5 < 0.8 < model.prior == model.alpha("new")
    assert model.trim(["new"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) != [[]]
    assert ngram.trim(["new"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) == [[]]
    model.observe("new", 1, 0)
    model.observe("new", 1, 0)
    assert model.trim(["new"], [[7, 8, 9, 10]], cost, 1, pass_seconds=_passes_of_30ms) == [[]]
    for method, earned in (("ngram", False), ("self_draft", True)):  # the scheduler's choice by method
        speculative = SpeculativeConfig(method=method, num_speculative_tokens=K)
        assert make_scheduler(num_blocks=64, block_size=4, speculative=speculative).adaptive.prior_from_engine == earned


def test_a_larger_step_measured_faster_than_the_plain_one_is_not_taken_for_free_drafts():
    """16 decodes; step 17 happened to be measured 1% faster than step 16 (noise): a draft that is
    right one time in five is still not worth a token's share of the step."""
    cost = _cost_model(0.050, 0.003)
    cost.observe(17, cost.measured(16) * 0.99)
    cost.observe(17, cost.measured(16) * 0.99)
    adaptive = AdaptiveSpeculation()
    for i in range(10):
        adaptive.observe("chat", 1, int(i % 5 == 0))
    assert adaptive.alpha("chat") < 0.3
    ids = ["chat"] + [f"r{i}" for i in range(15)]
    assert adaptive.trim(ids, [[3]] + [[]] * 15, cost, 16) == [[]] * 16


def test_a_draft_models_catch_up_on_a_request_is_priced_once_over_the_tokens_it_has_left():
    """A draft model computes a request's tokens before its first drafts for it, here 10 ms a
    token. Two requests the draft model is always right for: the one it already holds drafts with
    no more tokens left than the new one; the new one, nine tokens left, does not (its 17 tokens'
    catch-up, spread over nine, costs more than drafts save), unless it has hundreds of tokens
    left. Before any catch-up is timed, it is free: tried, and so timed."""
    sched = make_scheduler(num_blocks=1024, block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                           speculative=SpeculativeConfig(method="self_draft", num_speculative_tokens=K))
    held = make_request(prompt=PROMPT, max_tokens=20)
    sched.add_request(held)
    _decode_steps(sched, {}, 1)  # the prompt
    sched.step_time = _cost_model(0.050, 0.0005)
    for _ in range(4):
        sched.observe_step(0, 0.0, K, K * 0.002, 1)
    assert all(d[held.request_id] > 0 for d in _decode_steps(sched, {held.request_id: True}, 2))
    sched.observe_step(0, 0.0, K, K * 0.002 + 17 * 0.010, 1, num_catch_up_tokens=17)
    assert sched.catch_up_seconds_per_token == pytest.approx(0.010)

    new, long = make_request(prompt=PROMPT, max_tokens=10), make_request(prompt=PROMPT, max_tokens=400)
    for request in (new, long):
        sched.add_request(request)
    _decode_steps(sched, {held.request_id: True}, 1)  # their prompts; `held` decodes beside them
    assert held.params.max_tokens - held.num_output_tokens <= new.params.max_tokens - new.num_output_tokens == 9
    sched.step_time.observe(3, 0.050 + 3 * 0.0005)  # the plain step of three decodes, timed
    drafted = _decode_steps(sched, {r.request_id: True for r in (held, new, long)}, 1)[0]
    assert drafted[held.request_id] > 0 and drafted[new.request_id] == 0 and drafted[long.request_id] > 0


def test_the_catch_up_is_spread_over_the_tokens_requests_like_it_have_emitted_not_over_its_cap():
    """Eight requests ended after 5 tokens each; a new one may emit 400 but is expected to emit
    4 more, too few to pay back its catch-up (170 ms, over 40 ms a token against a 50 ms step):
    no drafts, where spread over its cap it would cost under 1 ms a token."""
    sched = make_scheduler(num_blocks=1024, block_size=4, max_num_seqs=8, max_num_batched_tokens=256,
                           speculative=SpeculativeConfig(method="self_draft", num_speculative_tokens=K))
    sched.step_time = _cost_model(0.050, 0.0005)
    short = [make_request(prompt=PROMPT, max_tokens=5) for _ in range(8)]
    for request in short:
        sched.add_request(request)
    _decode_steps(sched, {}, 5)
    assert not sched.has_unfinished()
    for _ in range(4):
        sched.observe_step(0, 0.0, K, K * 0.002, 1)
    sched.observe_step(0, 0.0, K, K * 0.002 + 17 * 0.010, 1, num_catch_up_tokens=17)
    late = make_request(prompt=PROMPT, max_tokens=400)
    sched.add_request(late)
    _decode_steps(sched, {}, 1)
    assert sched.output_lengths.expected_remaining(late.num_output_tokens, 400) == pytest.approx(4)
    assert _decode_steps(sched, {late.request_id: True}, 1)[0][late.request_id] == 0


def test_a_size_not_measured_yet_is_priced_from_the_plain_step_not_from_the_line():
    """The line is fitted over a prefill and slow first steps as well as the plain steps of 8
    decodes, now 1 ms: its value for 9 tokens is far above 1 ms. Priced from the plain step plus
    the fitted cost of a token, a first draft at the prior 0.5 pays, and is tried (then measured)."""
    model = StepTimeModel()
    for tokens, seconds in [(300, 0.017), (8, 0.007), (8, 0.005), (8, 0.004)] + [(8, 0.001)] * 12:
        model.observe(tokens, seconds)
    fixed, per_token = model.fit()
    base = model.measured(8)
    assert fixed + 9 * per_token > 1.5 * base  # the line at 9 tokens
    assert 8.5 / (base + per_token) > 8 / base  # one more token for half a token pays
    ids = [f"r{i}" for i in range(8)]
    assert AdaptiveSpeculation().trim(ids, [[5]] * 8, model, 8) == [[5]] * 8


def test_a_pass_size_not_timed_yet_is_priced_from_the_nearest_one_timed_and_then_by_its_own_time():
    """Only single-request passes timed (8 ms each, as at batch 1): every step had one size, so no
    per-request cost can be separated. A pass over 4 requests is priced at 8 ms, the nearest size's
    time, not 32 (all of it charged per request, the line's cautious reading, which kept batch 4
    from ever drafting for requests the draft model is always right for); once timed, its own."""
    sched = make_scheduler(num_blocks=64, block_size=4,
                           speculative=SpeculativeConfig(method="self_draft", num_speculative_tokens=K))
    for _ in range(6):
        sched.observe_step(0, 0.0, K, K * 0.008, 1)
    assert sched.draft_pass_time.fit()[1] == pytest.approx(0.008)  # the line: all of it per request
    assert sched.draft_pass_seconds(4) == pytest.approx(0.008)
    adaptive = AdaptiveSpeculation(prior_from_engine=True)
    for _ in range(40):
        adaptive.observe("earlier", K, K)  # the draft model's drafts were all accepted at batch 1
    # four new requests, each to be caught up on (3 ms per token it emits), a 44 ms plain step
    ids, drafts, catch_up = [f"r{i}" for i in range(4)], [[7, 8, 9, 10]] * 4, [0.003] * 4
    cost = _cost_model(0.0408, 0.0008)
    assert adaptive.trim(ids, drafts, cost, 4, sched.draft_pass_seconds, catch_up) == drafts
    assert adaptive.trim(ids, drafts, cost, 4, lambda n: 0.008 * n, catch_up) == [[]] * 4  # passes at 32 ms
    for _ in range(3):
        sched.observe_step(0, 0.0, K, K * 0.030, 4)
    assert sched.draft_pass_seconds(4) == pytest.approx(0.030, rel=0.01)
