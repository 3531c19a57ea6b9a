"""quantization='int8' (engine/models/linear.py): the C++ kernel computes what fp32 GEMM computes on
the same dequantized weights; teacher-forced quality against the fp32 engine on the shipped text
(engine/quality.py); greedy output the same alone and in any batch, under every scheduler feature."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cpu_kernels import load_cpu_kernels
from engine.model_loader import load_model
from engine.models.linear import Int8Linear, Linear
from engine.quality import compare, eval_tokens, position_logits
from tests.engine.test_parity import _prompts


@pytest.mark.parametrize("cols", [64, 96, 40])  # 40: not a multiple of the group, one group per row
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_int8_kernel_computes_the_gemm_of_the_dequantized_weights(cols, with_bias):
    torch.manual_seed(0)
    dense = Linear(torch.randn(48, cols) * 0.05, torch.randn(48) if with_bias else None)
    kernels = load_cpu_kernels()
    assert kernels is not None
    layer = Int8Linear(dense, kernels)
    assert layer.qweight.dtype == torch.int8
    assert (layer.weight - dense.weight).abs().max() <= layer.scale.max() / 2 + 1e-7  # rounding error bound
    for rows in range(1, Int8Linear.DECODE_ROWS + 1):
        x = torch.randn(rows, cols)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.t().contiguous().t()), want, rtol=1e-5, atol=1e-5)  # strided input


def _quality(model: str | None, num_tokens: int, min_margin: float = 0.0):
    ref = load_model(EngineConfig.from_kwargs(model=model).model)
    quant = load_model(EngineConfig.from_kwargs(model=model, quantization="int8").model)
    assert quant.weight_bytes_per_token < 0.3 * ref.weight_bytes_per_token
    ids = eval_tokens(ref.tokenizer, num_tokens)
    return compare(position_logits(ref, ids), position_logits(quant, ids), ids, min_margin=min_margin)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_int8_quality_against_fp32_on_tiny_models(model, request):
    """Random models are nearly flat (perplexity in the thousands): top-1 agreement counts the
    positions whose reference argmax leads by at least 0.2 logits (their logits spread with std ~2.4)."""
    quality = _quality(request.getfixturevalue(model), 2048, min_margin=0.2)
    assert quality.top1_agreement >= 0.97, quality
    assert abs(quality.perplexity_increase) <= 0.03, quality


@pytest.mark.slow
def test_int8_quality_against_fp32_on_the_embedded_model():
    """6,000 tokens of the shipped text: top-1 agreement >= 97%, perplexity within 3%."""
    quality = _quality(None, 6000)
    print(f"int8 vs fp32: {quality}")
    assert quality.top1_agreement >= 0.97, quality
    assert abs(quality.perplexity_increase) <= 0.03, quality


@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=64),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunked prefill
    dict(max_num_seqs=3, max_num_batched_tokens=7, block_size=4),
    dict(max_num_seqs=64, enable_prefix_caching=False),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"),
])
def test_int8_greedy_is_the_same_alone_and_in_a_batch_under_every_scheduler_feature(tiny_llama, engine_args):
    prompts = _prompts(12, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = LLM(model=tiny_llama, quantization="int8", max_num_seqs=1)
    want = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(model=tiny_llama, quantization="int8", **engine_args)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
