"""Property test: random arrivals, lengths, forks (n > 1), shared prefixes, aborts, requests that
fail mid-batch, preemption and speculative drafts (a random number of them accepted, the rest
rolled back) through the real scheduler and KV manager, with one KV group of full attention or
groups of sliding windows beside a full one (their passed blocks dropped as requests go);
accounting is exact after every step."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SpeculativeConfig
from engine.kv_cache.layout import KVLayout
from engine.outputs import ModelRunnerOutput
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from tests.engine.helpers import make_scheduler

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26]]

request_spec = st.tuples(
    st.integers(0, 2),  # shared prefix: none, or one of PREFIXES (prefix-cache hits)
    st.integers(1, 24),  # own prompt tokens
    st.integers(1, 12),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 2),  # priority
)
# new requests, abort one group?, which group, fail one sampled request this step?
step_spec = st.tuples(st.lists(request_spec, max_size=3), st.booleans(), st.integers(0, 10_000), st.booleans())


@settings(max_examples=120, deadline=None)
@given(steps=st.lists(step_spec, min_size=1, max_size=30),
       mode=st.sampled_from(["recompute", "swap", "auto"]),
       policy=st.sampled_from(["fcfs", "sjf", "priority", "static"]),
       num_blocks=st.integers(10, 40), budget=st.integers(4, 48), seed=st.integers(0, 1000),
       speculate=st.booleans(), windows=st.sampled_from([(None,), (None, 6), (8, 8, None), (5,)]))
def test_blocks_are_exactly_accounted(steps, mode, policy, num_blocks, budget, seed, speculate, windows):
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False) if speculate else None
    layout = KVLayout.for_windows(windows, 64)
    sched = make_scheduler(num_blocks=num_blocks * layout.num_groups, block_size=4, num_host_blocks=12,
                           preemption_mode=mode, policy=policy, max_num_batched_tokens=budget, max_num_seqs=6,
                           max_model_len=64, speculative=spec, layout=layout)
    token = seed
    count = proposed = 0
    for new, abort, pick, fail in steps + [([], False, 0, False)] * 400:
        for prefix, own, max_tokens, n, priority in new:
            prompt = (PREFIXES[prefix - 1] if prefix else []) + [(token + i) % 50 + 1 for i in range(own)]
            request = Request(f"g{count}", prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=0),
                              priority=priority)
            count += 1
            try:
                sched.add_request(request)
            except ValueError:
                continue  # never fits in this tiny cache: rejected up front, nothing allocated
        if abort and sched.requests:
            group = sorted({r.group_id for r in sched.requests.values()})[pick % len({
                r.group_id for r in sched.requests.values()})]
            sched.finish_group(group, FinishReason.ABORT)
        out = sched.schedule()
        sampled = {}
        for item in out.scheduled:
            token = (token * 1103515245 + 12345) % (1 << 31)
            accepted = item.draft_token_ids[:token % (len(item.draft_token_ids) + 1)]
            sampled[item.request.request_id] = accepted + [token % 60]  # 0 is eos: some requests stop early
        due = [item.request.request_id for item in out.scheduled if item.sample]
        errors = {due[pick % len(due)]: RuntimeError("injected")} if fail and due else {}
        proposed += sum(len(item.draft_token_ids) for item in out.scheduled)
        update = sched.update_from_output(out, ModelRunnerOutput(sampled, {}, errors))
        assert not any(r.group_id in update.failed for r in sched.requests.values())  # failed whole
        sched.kv.check_integrity()
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "requests left unfinished: the scheduler stalled"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_blocks
    # drafts of a group that failed in their step are not counted
    assert sched.counters.spec.proposed <= proposed and (proposed == 0 or speculate)
