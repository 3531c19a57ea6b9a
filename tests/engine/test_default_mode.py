"""The default mode (quantization `auto`, engine/quantization_check.py): chosen by the serving mix
(engine/serving_mix.py) among the modes that pass the quality check, decided once per model and
machine and read back on every later start; `quantization: none` stays the exact reference."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, cpu_load, model_setup
from engine import quantization_check as qc
from engine.config import ModelConfig
from engine.cpu_kernels import load_cpu_kernels
from engine.cpu_load import OtherLoad
from engine.model_loader import converted_gguf, default_model_path
from engine.model_setup import load_model
from engine.quality import Quality
from engine.serving_mix import SERVING_MIX, MixTiming


def _timing(single: float, saturated: float) -> MixTiming:
    """A MixTiming whose lone-stream step takes `single` and every saturated step `saturated`."""
    return MixTiming({s.name: (single if s.single_stream_weight else saturated) for s in SERVING_MIX})


def test_modes_are_scored_fastest_on_the_serving_mix_first():
    """The figures `auto` timed on an AMD EPYC (Zen 4, no AMX) for the embedded model converted to
    a Hugging Face directory; a mode slower than fp32 on the mix is never scored."""
    steps = [s.name for s in SERVING_MIX]
    timings = {mode: MixTiming(dict(zip(steps, ratios))) for mode, ratios in {
        "int8": (0.16, 0.42, 1.00, 1.00), "w4a16": (0.35, 0.45, 0.57, 0.63), "w8a16": (0.41, 0.44, 0.63, 0.76)}.items()}
    assert qc.scoring_order(timings) == ["w4a16", "int8", "w8a16"]
    timings["w8a16"] = _timing(1.5, 1.2)
    assert qc.scoring_order(timings) == ["w4a16", "int8"]


@pytest.mark.slow
def test_a_ggufs_own_blocks_are_run_untimed_however_busy_the_machine(tmp_path, monkeypatch):
    """The embedded GGUF's blocks pass their check: `auto` runs them without timing anything, so
    a first start after an install on a busy machine decides what a quiet one does."""
    load_cpu_kernels()
    model = default_model_path()
    converted_gguf(model)  # the conversion and the kernels in the usual cache, linked into a fresh one
    for kind in ("kernels", "models"):
        (tmp_path / kind).symlink_to(qc.cache_dir(kind))
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("a GGUF whose blocks pass is not timed")

    monkeypatch.setattr(qc, "time_mix", refuse)
    spinners = _spinners(os.cpu_count(), 120)
    try:
        loaded = load_model(ModelConfig(quality_check_tokens=2000))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert (loaded.quantization, loaded.kv_cache_dtype) == ("gguf", torch.float16) and loaded.quality.passes
    [decision_file] = (tmp_path / "decisions").glob("*.json")
    decision = json.loads(decision_file.read_text())
    assert decision["timings"] == {} and decision["contended_cores"] is None and qc.contended_decisions() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 1.5), st.floats(0.05, 1.5), st.booleans()), min_size=1, max_size=4))
def test_the_first_passing_mode_is_never_beaten_on_both_a_lone_stream_and_a_saturated_server(modes):
    names = ["int8", "w4a16", "w8a16", "other"][:len(modes)]
    timings = {n: _timing(single, sat) for n, (single, sat, _) in zip(names, modes)}
    passes = {n for n, (_, _, ok) in zip(names, modes) if ok}
    chosen = next((m for m in qc.scoring_order(timings) if m in passes), None)
    if chosen is None:  # fp32 stays: no passing mode beats it on the mix
        assert all(timings[m].mix >= 1 for m in passes)
        return
    assert timings[chosen].mix < 1
    assert not any(timings[chosen].beaten_on_both_by(timings[m]) for m in passes)


def test_the_decision_is_cached_and_a_restart_neither_times_nor_scores(tiny_llama, tmp_path, monkeypatch):
    """The first start times every candidate on the real serving-mix steps and scores the ones
    faster than fp32 (a random model's logits are nearly flat: none passes, fp32 stays); the
    decision file is then all a restart reads. Its contents are what the engine runs: edited to
    w8a16 with an fp16 cache and given figures, the next start runs exactly that."""
    load_cpu_kernels()  # the mix runs through the engine's attention kernel, built in the usual cache
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(qc, "AUTO_CANDIDATES", ("w4a16", "w8a16"))  # no block kernels needed
    first = load_model(ModelConfig(model=tiny_llama, quality_check_tokens=1024))
    assert first.quantization == "none" and first.kv_cache_dtype == torch.float32
    [decision_file] = (tmp_path / "decisions").glob("*.json")
    decision = json.loads(decision_file.read_text())
    assert set(decision["timings"]) == {"w4a16", "w8a16"}
    assert all(set(ratios) == {s.name for s in SERVING_MIX} and all(r > 0 for r in ratios.values())
               for ratios in decision["timings"].values())

    def refuse(*args, **kwargs):
        raise AssertionError("a restart must not time or score")

    monkeypatch.setattr(qc, "time_mix", refuse)
    monkeypatch.setattr(qc, "token_scores", refuse)
    assert load_model(ModelConfig(model=tiny_llama, quality_check_tokens=1024)).quantization == "none"
    figures = {"top1_agreement": 0.99, "perplexity": 10.1, "reference_perplexity": 10.0}
    decision_file.write_text(json.dumps({**decision, "mode": "w8a16", "kv_cache_dtype": "float16",
                                         "quality": figures}))
    deepcopy = qc.copy.deepcopy

    def no_model_copies(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module):
            raise AssertionError("a restart quantizes the loaded model itself: a copy doubles the start's memory")
        return deepcopy(obj, *args, **kwargs)

    monkeypatch.setattr(qc.copy, "deepcopy", no_model_copies)
    llm = LLM(tiny_llama, quality_check_tokens=1024, kv_cache_memory_bytes=1 << 20)
    report = llm.engine.model_report
    assert (report.quantization, report.kv_cache_dtype, report.top1_agreement) == ("w8a16", "float16", 0.99)
    assert llm.engine.loaded.quality == Quality(**figures)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0
    # an explicit mode or cache is not the decision's: fp32 stays the exact reference
    assert load_model(ModelConfig(model=tiny_llama, quantization="none")).kv_cache_dtype == torch.float32


def _spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes each spinning on a core for `seconds`, started (interpreters up)."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    time.sleep(0.3)
    return spinners


def test_other_load_is_the_machine_s_busy_time_less_this_process_s():
    # 1.5 busy CPU-s in a second of which this process took 0.9: the others took 0.6 of a core
    assert cpu_load.others_cores((100.0, 10.0, 5.0), (101.5, 10.9, 6.0)) == pytest.approx(0.6)
    assert cpu_load.others_cores((100.0, 10.0, 5.0), (100.5, 10.9, 6.0)) == 0.0  # clock ticks round: never below 0
    assert cpu_load.others_cores((None, 10.0, 5.0), (101.0, 10.9, 6.0)) is None  # no /proc/stat
    [spinner] = _spinners(1, 1.5)  # a spinning process is counted, however busy the rest of the machine
    with OtherLoad() as other:
        time.sleep(0.6)
    spinner.wait()
    assert other.cores >= 0.6


def _quiet_machine(monkeypatch) -> None:
    """Other processes read as taking nothing, however busy the machine really is."""
    monkeypatch.setattr(cpu_load, "others_cores", lambda start, end: 0.0)


def test_a_decision_timed_while_other_processes_took_the_cores_is_kept_marked_and_retimed_later(
        tiny_llama, tmp_path, monkeypatch):
    """Every core taken by a spinning process while the modes are timed: the timings are not the
    machine's (each mode's skewed by how it shares a core), yet the decision is kept, marked with
    that load, so the next start reads it instead of timing on a busy machine again; a retime on
    a quiet machine replaces it with one unmarked."""
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(qc, "AUTO_CANDIDATES", ("w4a16", "w8a16"))  # no block kernels needed
    timed = []

    def time_mix(model, fp32_model, kv_cache_dtype, max_model_len):
        timed.append(model)
        time.sleep(0.5)  # the span the rest of the machine is measured over
        return _timing(1.5, 1.5)  # slower than fp32: nothing is scored, fp32 stays

    monkeypatch.setattr(qc, "time_mix", time_mix)
    spinners = _spinners(os.cpu_count(), 10)
    try:
        assert load_model(ModelConfig(model=tiny_llama)).quantization == "none"
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    [marked] = qc.contended_decisions()
    assert len(timed) == 2 and json.loads(marked.read_text())["contended_cores"] > 0.25
    assert load_model(ModelConfig(model=tiny_llama)).quantization == "none"  # a start reads it, however busy
    assert len(timed) == 2
    _quiet_machine(monkeypatch)
    assert load_model(ModelConfig(model=tiny_llama), retime_contended=True).quantization == "none"
    assert len(timed) == 4 and qc.contended_decisions() == []
    assert json.loads(marked.read_text())["contended_cores"] is None


def test_a_retime_waits_for_a_quiet_span_and_does_nothing_with_no_marked_decision(tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("nothing to retime: no model is loaded")

    monkeypatch.setattr(model_setup, "load_model", refuse)
    model_setup.main(["--retime"])
    readings = iter([1.9, 1.9, 0.1])  # busy spans, then a quiet one
    monkeypatch.setattr(cpu_load, "others_cores", lambda start, end: next(readings))
    monkeypatch.setattr(model_setup.time, "sleep", lambda s: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: os.cpu_count())
    assert model_setup.wait_for_a_quiet_machine(wait_s=60) is True
    readings = iter([1.9] * 1000)
    assert model_setup.wait_for_a_quiet_machine(wait_s=0) is False


def test_auto_is_fp32_where_the_quantized_kernels_do_not_run(tiny_llama):
    """16-bit weights on CPU (and CUDA, config-level): the quantized kernels compute in float32."""
    assert ModelConfig(dtype="bfloat16").quantization == "auto"
    loaded = load_model(ModelConfig(model=tiny_llama, dtype="bfloat16"))
    assert (loaded.quantization, loaded.kv_cache_dtype) == ("none", torch.bfloat16)


@pytest.mark.slow
def test_with_no_quantization_given_the_embedded_model_runs_its_own_blocks_through_an_fp16_cache():
    """`make install` decided it; this start reads the decision."""
    report = LLM(kv_cache_memory_bytes=1 << 26).engine.model_report
    assert (report.quantization, report.kv_cache_dtype) == ("gguf", "float16")
    assert report.top1_agreement >= 0.97 and abs(report.perplexity_increase) <= 0.03


@pytest.mark.slow
def test_a_converted_checkpoint_runs_the_first_mode_in_scoring_order_that_passes(tmp_path, monkeypatch):
    """The embedded GGUF converted to a Hugging Face directory (no blocks of its own): `auto` times
    int8, w4a16 and w8a16 and runs the first in scoring order that passes; every mode before it
    failed its check (the figures are cached beside the decision)."""
    directory = str(converted_gguf(default_model_path()))  # in the usual cache, as the kernels
    load_cpu_kernels()
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))
    loaded = load_model(ModelConfig(model=directory, quality_check_tokens=2000))
    [decision_file] = (tmp_path / "decisions").glob("*.json")
    timings = {m: MixTiming(r) for m, r in json.loads(decision_file.read_text())["timings"].items()}
    assert set(timings) == {"int8", "w4a16", "w8a16"}
    order = qc.scoring_order(timings)
    assert loaded.quantization in order and loaded.quality.passes, (loaded.quantization, loaded.quality)
    for earlier in order[:order.index(loaded.quantization)]:
        scored = [Quality(**json.loads(f.read_text())) for f in (tmp_path / "quality").glob(f"*-{earlier}-*.json")]
        assert scored and not any(q.passes for q in scored), earlier
    prompt = random.Random(0).sample(range(100, 1000), 24)
    out = LLM(directory, quality_check_tokens=2000, kv_cache_memory_bytes=1 << 26).generate(
        [prompt], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0
