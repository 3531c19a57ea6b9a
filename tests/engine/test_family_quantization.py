"""The quantized modes on every family: int8 and the weight-only modes scored against fp32, the
fused decode stack computing what the layers compute for every layer shape (q/k norms, post-norms,
GeGLU, sliding-window groups, experts), a GGUF of a new family (Q8_0, written by the gguf
package's writer) run in its own blocks, and the transformers path quantized layer by layer."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_setup import load_model
from engine.models.linear import BlockQuantLinear, Linear
from engine.quality import compare, eval_tokens, token_scores
from tests.conftest import NATIVE_ARCHS, save_tiny_model
from tests.engine.gguf_files import write_gguf
from tests.engine.test_families import shared_prefix_prompts

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
POST_NORM_ARCHS = ("gemma2", "gemma3")


@pytest.mark.parametrize("mode", ["int8", "w8a16"])
@pytest.mark.parametrize("arch", [a for a in NATIVE_ARCHS if a not in ("llama", "qwen2")] + ["gpt2", "opt"])
def test_quantized_modes_against_fp32_on_every_family(arch, mode, tmp_path):
    """Random models are nearly flat: top-1 agreement counts the positions whose reference argmax
    leads by 0.2 logits. With experts, a rounding moves a token to another expert where the random
    router is near a tie, and its logits with it: those families are held to 92%."""
    model = save_tiny_model(tmp_path / arch, arch)
    ref = load_model(EngineConfig.from_kwargs(model=model, quantization="none").model)
    quant = load_model(EngineConfig.from_kwargs(model=model, quantization=mode, quality_check_tokens=0).model)
    ids = eval_tokens(ref.tokenizer, 2048)
    quality = compare(token_scores(ref.model, ids), token_scores(quant.model, ids), min_margin=0.2)
    assert quality.top1_agreement >= (0.92 if arch in MOE_ARCHS else 0.97), quality
    assert abs(quality.perplexity_increase) <= 0.03, quality
    assert quant.weight_bytes_per_token < 0.5 * ref.weight_bytes_per_token


@pytest.mark.parametrize("arch", [a for a in NATIVE_ARCHS if a not in ("llama", "qwen2")])
def test_the_fused_stack_computes_what_the_layers_compute_for_every_layer_shape(arch, tmp_path):
    """int8 decode steps through the C++ stack and through the layers' own modules: the same tokens;
    bit for bit where the layer path runs the stack's own kernels throughout, and within a rounding
    of the activations where it computes post-norms or routing in torch."""
    model = save_tiny_model(tmp_path / arch, arch)
    prompts = shared_prefix_prompts(6, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    runs = {}
    for fused in (True, False):
        llm = LLM(model, quantization="int8", quality_check_tokens=0, max_num_seqs=4)
        paged = llm.engine.loaded.model
        assert paged.decode_stack is not None
        if not fused:
            paged.decode_stack = None
        runs[fused] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    for fused, layered in zip(runs[True], runs[False]):
        if arch not in MOE_ARCHS + POST_NORM_ARCHS:
            assert fused.logprobs == layered.logprobs
            continue
        for a, b in zip(fused.logprobs, layered.logprobs):
            assert all(abs(a[token] - b[token]) < 0.05 for token in a.keys() & b.keys())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_gguf_of_a_new_family_runs_in_its_own_blocks(arch, tmp_path):
    """A Qwen3 (and a Qwen3-MoE, its experts stacked in 3-D tensors) GGUF in Q8_0: every matmul, each
    expert's too, runs the file's blocks (the decode stack on), and decodes the tokens of the fp32
    model dequantized from the same file."""
    sizes = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)  # transformers'
    if arch == "qwen3_moe":  # GGUF reader keeps Qwen3's head_dim and Qwen3-MoE's expert width at their defaults
        sizes |= dict(mlp_only_layers=[], moe_intermediate_size=768)
    path = write_gguf(save_tiny_model(tmp_path / "hf", arch, **sizes), str(tmp_path / f"{arch}.gguf"))
    prompts = shared_prefix_prompts(4, seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    fp32 = LLM(path, quantization="none")
    blocks = LLM(path, quantization="gguf", quality_check_tokens=0)
    matmuls = [m for m in blocks.engine.loaded.model.modules() if isinstance(m, (Linear, BlockQuantLinear))]
    assert matmuls and all(isinstance(m, BlockQuantLinear) for m in matmuls)
    if arch == "qwen3_moe":
        assert len(matmuls) == 3 * (2 + 2 * 4) + 1  # per layer qkv, o and 4 experts' two; the LM head
    assert blocks.engine.loaded.model.decode_stack is not None
    assert ([o.outputs[0].token_ids for o in blocks.generate(prompts, greedy, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in fp32.generate(prompts, greedy, use_tqdm=False)])


def test_a_model_through_transformers_code_runs_quantized_layer_by_layer(tmp_path, caplog):
    model = save_tiny_model(tmp_path / "gpt2", "gpt2")
    with caplog.at_level("INFO"):
        llm = LLM(model, quantization="int8", quality_check_tokens=0)
    paged = llm.engine.loaded.model
    assert paged.decode_stack is None and "transformers' modeling code" in caplog.text
    quantized = [m for m in paged.modules() if isinstance(m, BlockQuantLinear)]
    assert len(quantized) == 2 * 4 + 1  # per layer c_attn, c_proj, c_fc, mlp's c_proj; the LM head
    prompts = shared_prefix_prompts(4, seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outputs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert all(len(o.token_ids) == 8 and all(torch.isfinite(torch.tensor(list(p.values()))).all() for p in o.logprobs)
               for o in outputs)


def test_auto_chooses_a_mode_for_a_new_family_and_serves_in_it(tmp_path, monkeypatch):
    """`auto` on a Gemma-3-shaped checkpoint: every candidate timed on the serving mix and scored
    in order; the chosen mode (fp32 where none passes) is what the model runs and reports."""
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model(tmp_path / "g3", "gemma3")
    llm = LLM(model, quality_check_tokens=600)
    report = llm.engine.model_report
    assert report.quantization in ("int8", "w4a16", "w8a16", "none") and report.model_path == "native"
    quantized = any(isinstance(m, BlockQuantLinear) for m in llm.engine.loaded.model.modules())
    assert quantized == (report.quantization == "int8")
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
