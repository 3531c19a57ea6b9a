"""A GGUF served from the file's own bytes (engine/model_loader.py, engine/models/gguf_blocks.py):
its blocks are the mapped file's pages, a tensor of a type no kernel runs is converted alone, no
fp32 copy of the model is made (the peak memory of a process loading it, measured), and a start
says what it does, phase by phase."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from engine import LLM, SamplingParams
from engine.cache_dir import cache_dir
from engine.config import ModelConfig
from engine.cpu_kernels import load_cpu_kernels
from engine.model_setup import load_model
from engine.models.gguf_blocks import BlockEmbedding
from engine.models.linear import BlockQuantLinear
from tests.conftest import save_tiny_model
from tests.engine.gguf_files import write_gguf

T = GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]


def _qwen3_gguf(directory: Path, hidden: int, layers: int, intermediate: int) -> str:
    """A Qwen3 GGUF in the mix llama-quantize writes for Q4_K_M (Q4_K, attn_v in Q6_K, the LM head
    in Q8_0), with layer 0's attn_output in F16, a type no kernel runs, and the embedding in Q8_0."""
    hf = save_tiny_model(directory / "hf", "qwen3", hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=intermediate, num_attention_heads=hidden // 128, num_key_value_heads=1,
                         head_dim=128)
    types = {f"blk.{i}.attn_v.weight": T.Q6_K for i in range(layers)}
    types |= {"blk.0.attn_output.weight": T.F16, "output.weight": T.Q8_0, "token_embd.weight": T.Q8_0}
    return write_gguf(hf, str(directory / "model.gguf"), T.Q4_K, types)


def test_a_ggufs_blocks_are_the_mapped_files_pages(tmp_path):
    load_cpu_kernels()
    path = _qwen3_gguf(tmp_path, 256, 2, 768)
    loaded = load_model(ModelConfig(model=path, quantization="gguf"))
    model = loaded.model
    matmuls = {name: m for name, m in model.named_modules() if isinstance(m, BlockQuantLinear)}
    converted = matmuls.pop("layers.0.o")  # F16: dequantized alone, to int8 blocks
    assert converted.bf16_activations and converted.qtypes == [T.Q8_0]
    assert [q.name for q in matmuls["layers.0.qkv"].qtypes] == ["Q4_K", "Q4_K", "Q6_K"]  # one part a tensor
    in_file = {name for name, m in matmuls.items() if m.qtypes != [T.Q8_0]}  # Q8_0 rows are regrouped
    assert in_file == {"layers.0.qkv", "layers.0.mlp.gate_up", "layers.0.mlp.down", "layers.1.qkv", "layers.1.o",
                       "layers.1.mlp.gate_up", "layers.1.mlp.down"}
    mapping = _mapping_of(path)
    for name in in_file:
        assert all(any(rows.data_ptr() in span for span in mapping) for rows in matmuls[name].part_rows), name
    assert isinstance(model.embed, BlockEmbedding)
    assert any(model.embed.blocks.data_ptr() in span for span in mapping)


def _mapping_of(path: str) -> list[range]:
    """The address ranges where this process maps `path` (/proc/self/maps)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(Path(path).resolve()):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            spans.append(range(low, high))
    return spans


PEAK_SCRIPT = """
import json, sys, resource
from engine.config import ModelConfig
from engine.model_loader import load_checkpoint
from engine.cpu_kernels import load_cpu_kernels
load_cpu_kernels()

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

before = status("VmRSS")
model = load_checkpoint(ModelConfig(model=sys.argv[1], quantization="gguf"), "gguf").model
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({"before": before, "peak": status("VmHWM"), "tensors": sum(tensors.values())}))
"""


@pytest.mark.slow
def test_loading_a_gguf_makes_no_fp32_copy(tmp_path):
    """The peak memory of a process loading a GGUF grows by its tensors (the file's pages where
    they are mapped, the batch GEMMs' tiles) and a matmul's temporaries: no fp32 copy of the model."""
    load_cpu_kernels()
    hidden, layers, intermediate = 1024, 8, 3072
    path = _qwen3_gguf(tmp_path, hidden, layers, intermediate)
    vocab = len(json.loads(
        (tmp_path / "hf" / "tokenizer.json").read_text())["model"]["vocab"])
    fp32_bytes = 4 * (layers * (hidden * (hidden + 2 * 128) + hidden * hidden + 3 * hidden * intermediate)
                      + 2 * vocab * hidden)
    cache_dir("models")  # the metadata converted in this process's cache first, as any start after the first
    load_model(ModelConfig(model=path, quantization="gguf"))
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, path], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["before"]
    # what one matmul's conversion holds for a moment (its tiles' temporaries), not a copy of the model:
    # a whole fp32 copy made on the way would grow the peak by fp32_bytes on top of the tensors
    assert growth <= figures["tensors"] + fp32_bytes / 2, (growth, figures, fp32_bytes)


def test_a_start_says_what_it_does_phase_by_phase(tmp_path, monkeypatch, caplog):
    """One line a phase, in order: the metadata read (a first start), the file read, the matmuls
    by type, the weights mapped and in memory, ready, the KV pool."""
    load_cpu_kernels()
    kernels = cache_dir("kernels")
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels)
    path = _qwen3_gguf(tmp_path, 256, 2, 768)
    with caplog.at_level("INFO"):
        LLM(path, kv_cache_memory_bytes=1 << 24)
    wanted = ["read the GGUF's config and tokenizer from its metadata", "reading ",
              "matmuls gguf: 11 Q4_K, 2 Q6_K, 1 int8, 1 Q8_0", "MB mapped from the file", "model ready in",
              "KV cache on cpu: "]
    messages = [r.getMessage() for r in caplog.records]
    found = [next(i for i, m in enumerate(messages) if w in m) for w in wanted]
    assert found == sorted(found), messages
    with caplog.at_level("INFO"):
        caplog.clear()
        LLM(path, kv_cache_memory_bytes=1 << 24)
    assert not any("from its metadata" in r.getMessage() for r in caplog.records)  # kept from the first start


def test_a_gguf_through_transformers_code_loads_dense_and_runs_its_matmuls_as_int8(tmp_path):
    """model_impl 'transformers': the file's tensors dequantized into transformers' modules one at a
    time (its own matmul layout, not the paged model's parts), every matmul then quantized to int8."""
    load_cpu_kernels()
    path = _qwen3_gguf(tmp_path, 256, 2, 768)
    llm = LLM(path, quantization="gguf", model_impl="transformers", kv_cache_memory_bytes=1 << 24)
    quantized = [m for m in llm.engine.loaded.model.modules() if isinstance(m, BlockQuantLinear)]
    assert quantized and all(m.bf16_activations for m in quantized)
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
