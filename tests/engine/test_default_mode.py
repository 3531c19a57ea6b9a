"""The default mode (quantization `auto`, engine/model_setup.py): picked by rule from the checkpoint
and the CPU, with nothing timed or scored at start; `quantization: none` stays the exact
reference; `cbserve check` scores a mode on demand (engine/quantization_check.py)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, cpu_load
from engine.cache_dir import cache_dir
from engine.cli import main as cli_main
from engine.config import ModelConfig
from engine.cpu_kernels import load_cpu_kernels
from engine.cpu_load import OtherLoad
from engine.model_setup import load_model
from engine.models.linear import BlockQuantLinear, Linear
from tests.conftest import save_tiny_model
from tests.engine.gguf_files import write_gguf


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


def test_auto_runs_a_ggufs_own_blocks_and_a_directory_in_int8_scoring_nothing(tiny_llama, tmp_path, monkeypatch):
    """The rule: a .gguf file its own blocks, a Hugging Face directory stored in 16 bits `int8` (the
    kernels load here), each through an fp16 KV cache, one stored in fp32 fp32; nothing is timed or
    scored (no figures written), and an explicit mode keeps the model's cache."""
    load_cpu_kernels()
    kernels = cache_dir("kernels")  # built in the usual cache, linked into a fresh one
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels)
    gguf = write_gguf(save_tiny_model(tmp_path / "hf", "qwen3", hidden_size=256, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=128), str(tmp_path / "q.gguf"))
    blocks = load_model(ModelConfig(model=gguf))
    assert (blocks.quantization, blocks.kv_cache_dtype, blocks.quality) == ("gguf", torch.float16, None)
    assert all(isinstance(m, BlockQuantLinear) for m in blocks.model.modules() if isinstance(m, Linear))
    published = save_tiny_model(tmp_path / "bf16", "llama")  # stored in 16 bits, as checkpoints are published
    AutoModelForCausalLM.from_pretrained(published, dtype=torch.bfloat16).save_pretrained(published)
    directory = load_model(ModelConfig(model=published))
    assert (directory.quantization, directory.kv_cache_dtype) == ("int8", torch.float16)
    exact = load_model(ModelConfig(model=tiny_llama))  # stored in fp32: its own precision
    assert (exact.quantization, exact.kv_cache_dtype) == ("none", torch.float32)
    explicit = load_model(ModelConfig(model=tiny_llama, quantization="int8"))
    assert (explicit.quantization, explicit.kv_cache_dtype) == ("int8", torch.float32)
    assert not (tmp_path / "cache" / "quality").exists() and not (tmp_path / "cache" / "decisions").exists()


def test_auto_is_fp32_where_the_quantized_kernels_do_not_run(tiny_llama):
    """16-bit weights on CPU (and CUDA, config-level): the quantized kernels compute in float32."""
    assert ModelConfig(dtype="bfloat16").quantization == "auto"
    loaded = load_model(ModelConfig(model=tiny_llama, dtype="bfloat16"))
    assert (loaded.quantization, loaded.kv_cache_dtype) == ("none", torch.bfloat16)


def test_cbserve_check_scores_the_mode_a_start_runs_and_the_next_start_reports_it(tiny_llama, tmp_path,
                                                                                  monkeypatch, capsys, caplog):
    """The check on a random model (flat logits: below the bar) exits 1 and logs the mode to run
    instead; its figures then reach the engine's model report."""
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))  # w8a16 needs no compiled kernels there
    with caplog.at_level("ERROR"):
        assert cli_main(["check", "--model", tiny_llama, "--quantization", "w8a16", "--quality-check-tokens",
                         "1024"]) == 1
    assert "quantization w8a16" in capsys.readouterr().out
    [failed] = [r.getMessage() for r in caplog.records if "QUALITY CHECK FAILED" in r.getMessage()]
    assert "run quantization 'int8' instead" in failed
    report = LLM(tiny_llama, quantization="w8a16", quality_check_tokens=1024,
                 kv_cache_memory_bytes=1 << 20).engine.model_report
    assert report.quantization == "w8a16" and 0 < report.top1_agreement < 0.97


@pytest.mark.slow
def test_with_no_quantization_given_the_embedded_model_runs_its_own_blocks_through_an_fp16_cache():
    report = LLM(kv_cache_memory_bytes=1 << 26).engine.model_report
    assert (report.quantization, report.kv_cache_dtype) == ("gguf", "float16")
