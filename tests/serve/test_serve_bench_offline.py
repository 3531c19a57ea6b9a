"""serve_bench's offline comparison submits the workload as a client with the same in-flight cap
would keep the served engine busy: waves only where the cap is below the engine's batch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.workload import DEFAULT_VOCAB_SIZE, make_workload  # noqa: E402
from tests.conftest import save_tiny_model  # noqa: E402


def test_the_offline_run_submits_in_waves_only_below_a_full_batch():
    assert serve_bench.offline_wave(2048, None, 256) == 2048  # a burst: all at once
    assert serve_bench.offline_wave(2048, 256, 256) == 2048  # a full batch in flight: the engine's queue refills
    assert serve_bench.offline_wave(2048, 512, 256) == 2048
    assert serve_bench.offline_wave(64, 1, 256) == 1  # the single stream
    assert serve_bench.offline_wave(64, 8, 256) == 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_offline_run_with_a_full_batch_in_flight_generates_every_token(tmp_path, async_scheduling):
    """Six requests through a two-row engine with the client's cap at two: submitted at once, the
    engine's queue holds the rest, and every request gets its exact output length. (The run's
    warm-up prompts are SmolLM2-sized ids: the model has that vocabulary.) With async scheduling,
    decode-only steps are launched ahead, and counted."""
    model = save_tiny_model(tmp_path, "llama", vocab_size=DEFAULT_VOCAB_SIZE)
    workload = make_workload(6, prompt_len_range=(4, 20), output_len_range=(2, 9), seed=3)
    engine_args = dict(max_num_seqs=2, quantization="none", async_scheduling=async_scheduling)
    result = serve_bench.run_offline_here(workload, model, engine_args, threads=1, max_concurrency=2)
    assert result["output_len_mismatches"] == []
    assert result["output_tokens"] == workload.num_output_tokens
    steps = result["engine_steps"]  # the timed run's alone: the warm-up's are left out
    mixed = steps["num_steps"] - steps["num_decode_only_steps"]
    assert 3 <= mixed and steps["num_decode_only_steps"] > 0  # a step prefills at most two of the six prompts
    assert steps["num_decode_only_steps"] <= steps["decode_only_rows"] <= 2 * steps["num_decode_only_steps"]
    assert steps["num_steps"] <= workload.num_output_tokens  # two rows a step: fewer steps than tokens
    assert steps["decode_only_steps_s"] > 0 and steps["mixed_steps_s"] > 0
    assert (steps["num_steps_ahead"] > 0) == async_scheduling
    assert steps["num_steps_ahead"] <= steps["num_decode_only_steps"]


def test_the_steps_line_gives_a_decode_only_steps_mean_rows_and_time():
    steps = dict(num_steps=12, num_decode_only_steps=10, decode_only_rows=25, decode_only_steps_s=0.05,
                 mixed_steps_s=0.02, num_steps_ahead=7)
    assert serve_bench.steps_line(steps) == ("12 steps: 10 decode-only (2.5 rows, 5.00 ms each) in 0.05 s, "
                                             "2 others in 0.02 s; 7 launched ahead")
    prefill_only = dict(steps, num_steps=2, num_decode_only_steps=0, decode_only_rows=0, decode_only_steps_s=0.0,
                        num_steps_ahead=0)
    assert serve_bench.steps_line(prefill_only) == ("2 steps: 0 decode-only in 0.00 s, 2 others in 0.02 s; "
                                                    "0 launched ahead")
