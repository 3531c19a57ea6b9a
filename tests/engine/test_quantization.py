"""Quantized execution (engine/models/linear.py, engine/models/gguf_blocks.py): the C++ kernel
computes what fp32 GEMM computes on the dequantized blocks with the quantized activations; `gguf`
runs the file's own blocks, exactly the weights of the fp32 model; teacher-forced quality
against the fp32 engine on the shipped text (engine/quality.py); greedy output the same alone and
in any batch, under every scheduler feature."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine import LLM, SamplingParams, quantization_check
from engine.config import EngineConfig, ModelConfig
from engine.cpu_kernels import load_cpu_kernels
from engine.model_setup import load_model
from engine.models import gguf_types
from engine.models.linear import (
    ACTIVATION_LEVELS,
    BLOCK,
    GATED_ACTIVATIONS,
    BlockQuantLinear,
    Linear,
    WeightOnlyLinear,
    bf16_pair_tiles,
    int8_blocks,
    prologue,
    quantize_activations,
)
from engine.quality import KV_CHUNK, compare, eval_tokens, token_scores
from tests.engine.gguf_files import quantize_blocks, random_blocks, write_gguf
from tests.engine.test_parity import _prompts

QTYPES = list(gguf_types.KERNEL_FORMATS)
KINDS = QTYPES + ["int8"]  # GGUF files' blocks with 15-bit activations; the int8 mode's, with bf16 ones
Q = GGMLQuantizationType


def _width(kind, blocks_of_32: int) -> int:
    """A row of `blocks_of_32` blocks of the kind (super-blocks of 256 for the K-quants and IQ4_XS)."""
    return blocks_of_32 * (32 if kind == "int8" else GGML_QUANT_SIZES[kind][0])


def _layer(kind, rows: int, cols: int, with_bias: bool) -> BlockQuantLinear:
    weight = torch.randn(rows, cols) * 0.05
    bias = torch.randn(rows) if with_bias else None
    if kind == "int8":
        return BlockQuantLinear([(Q.Q8_0, int8_blocks(weight))], bias, load_cpu_kernels(), bf16_activations=True)
    return BlockQuantLinear([(kind, quantize_blocks(weight.numpy(), kind))], bias, load_cpu_kernels())


def _name(kind) -> str:
    return kind if isinstance(kind, str) else kind.name


@pytest.mark.parametrize("kind", KINDS, ids=_name)
# blocks: a tail only, groups of 4 and a tail of 1, of 2 (SmolLM2's 576 columns: 18 blocks), groups only
@pytest.mark.parametrize("blocks", [3, 5, 6, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_computes_the_gemm_of_the_dequantized_weights_and_quantized_activations(kind, blocks, with_bias):
    torch.manual_seed(0)
    assert load_cpu_kernels() is not None
    cols = _width(kind, blocks)
    layer = _layer(kind, 48, cols, with_bias)
    close = dict(rtol=1e-5, atol=1e-5 * (cols / 96) ** 0.5)
    for rows in range(1, BlockQuantLinear.DECODE_ROWS + 1):
        x = torch.randn(rows, cols)
        want = torch.nn.functional.linear(layer.activations(x), layer.weight, layer.bias)
        got = layer.forward_kernel(x)
        torch.testing.assert_close(got, want, **close)
        assert torch.equal(layer.forward_kernel(x[-1:]), got[-1:])  # a row's bits alone as in the batch
        torch.testing.assert_close(layer.forward_kernel(x.t().contiguous().t()), want, **close)  # strided
        torch.testing.assert_close(layer(x), want, **close)  # whichever path this many rows take
        torch.testing.assert_close(layer(x.repeat(2, 1))[:rows], want, **close)  # the large-batch path
        torch.testing.assert_close(layer.forward_gemm(x), want, **close)  # fp32 GEMM (CPUs without AMX)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@pytest.mark.parametrize("blocks", [3, 5, 48])  # odd (a pass's last block alone), even, the model's down
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_tile_gemm_computes_the_kernels_products_on_cpus_with_amx(kind, blocks, with_bias):
    """Where the CPU has AMX tiles, large batches run the tile GEMM (on the blocks' integers; with
    bf16 activations past INTEGER_TILE_ROWS on the weights as exact bf16 pairs): the same values
    as fp32 GEMM of the dequantized weights, at any row count (partial tiles of 16 rows) and output
    width (48 = three column groups), and each row's output is the same bits in any batch that
    takes the same tiles. Where it has none, the layer keeps fp32 GEMM and the kernels refuse.
    Q6_K's integers (its sub-block scales folded in) pass bf16's 8 bits: it takes the vector GEMM."""
    torch.manual_seed(5)
    kernels = load_cpu_kernels()
    cols = 1536 if blocks == 48 else _width(kind, blocks)  # the model's down: 6 super-blocks of the K-quants
    layer = _layer(kind, 48, cols, with_bias)
    assert layer.tiled == (kernels.block_quant_gemm_available() and kind != Q.Q6_K)
    if kind == Q.Q6_K:
        return
    if not layer.tiled:
        with pytest.raises(RuntimeError, match="AMX"):
            kernels.block_quant_gemm(torch.randn(16, cols), torch.zeros(3, cols // BLOCK, 512, dtype=torch.bfloat16),
                                     torch.zeros(cols // BLOCK, 48), None, None, None, 0.0, False, None, False)
        with pytest.raises(RuntimeError, match="AMX"):
            kernels.bf16_tile_gemm(torch.randn(16, cols), torch.zeros(3, cols // BLOCK, 1024, dtype=torch.bfloat16),
                                   None, None, 0.0, 0, None)
        return
    assert layer.decode_rows == BlockQuantLinear.TILED_DECODE_ROWS
    pairs = kind == "int8"
    batch = torch.randn(140, cols) * torch.logspace(-2, 2, cols)
    residual = torch.randn(140, 48)
    whole = layer.forward_tiles(batch, residual=residual)
    for rows in (1, 5, 16, 17, 33, 64, 65, 70):
        x = batch[:rows]
        want = torch.nn.functional.linear(layer.activations(x), layer.weight, layer.bias)
        got = layer.forward_tiles(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * (cols / 96) ** 0.5)
        # each within that of the reference, so within twice that of each other
        torch.testing.assert_close(got, layer.forward_kernel(x), rtol=2e-5, atol=2e-5 * (cols / 96) ** 0.5)
        if not pairs or rows > BlockQuantLinear.INTEGER_TILE_ROWS:  # the tiles `whole` took
            assert torch.equal(layer.forward_tiles(x, residual=residual[:rows]), whole[:rows])
        if not pairs or rows <= BlockQuantLinear.INTEGER_TILE_ROWS:  # the tiles one row takes
            assert torch.equal(layer.forward_tiles(batch[rows - 1:rows])[0], got[-1])
    shifted = layer.forward_tiles(batch[7:77], residual=residual[7:77])  # other rows around, the same tiles
    assert torch.equal(shifted, whole[7:77])
    assert torch.equal(layer(batch[:9]), layer.forward_tiles(batch[:9]))  # past decode_rows: the tiles


def test_int8_blocks_hold_every_weight_as_two_bf16_values():
    """The int8 mode's scales have at most 8 significant bits (stored fp16), so d * q is exactly a
    bf16 pair, also where the scale is an fp16 subnormal; each weight is within half a step of w."""
    torch.manual_seed(6)
    weight = torch.randn(32, 4 * BLOCK) * torch.logspace(-9, 1, 4 * BLOCK)
    weight[0, :BLOCK] = 0  # an all-zero block
    blocks = int8_blocks(weight)
    scales = torch.from_numpy(blocks.reshape(32, 4, 34)[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert torch.equal(scales.bfloat16().float(), scales)
    layer = BlockQuantLinear([(Q.Q8_0, blocks)], None, None, bf16_activations=True)
    bf16_pair_tiles(layer.weight)  # raises unless every weight is exactly hi + lo
    step = weight.view(32, 4, BLOCK).abs().amax(-1, keepdim=True) / 127
    error = (layer.weight - weight).view(32, 4, BLOCK).abs()
    normal = step >= 2 * torch.finfo(torch.float16).tiny  # blocks whose scale keeps its 8 bits in fp16
    assert (error <= step * 0.51)[normal.expand_as(error)].all()
    # tiny blocks: the scale rounded to an fp16 subnormal (steps of 2^-24), so q by up to 127 such steps
    assert (error <= step * 0.51 + 127 * 2 ** -25)[~normal.expand_as(error)].all()
    assert torch.equal(layer.weight[0, :BLOCK], torch.zeros(BLOCK))
    with pytest.raises(ValueError, match="Q8_0"):
        BlockQuantLinear([(Q.Q4_1, quantize_blocks(weight.numpy(), Q.Q4_1))], None, None, bf16_activations=True)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@pytest.mark.parametrize("fusion", ["norm", "silu", "gelu_tanh", "gelu", "residual", "norm+residual"])
def test_the_kernels_fused_prologue_and_residual_compute_what_the_torch_ops_compute(kind, fusion):
    torch.manual_seed(2)
    cols = _width(kind, 2)
    layer = _layer(kind, 48, cols, with_bias=True)
    reference = Linear(layer.weight, layer.bias)  # the fp32 ops on the same (dequantized) weights
    gated = fusion if fusion in GATED_ACTIVATIONS else None
    for rows in (1, 3, layer.decode_rows):
        x = torch.randn(rows, 2 * cols if gated else cols) * 3
        kwargs = dict(norm=(torch.rand(cols) + 0.5, 1e-5) if "norm" in fusion else None, gated=gated,
                      residual=torch.randn(rows, 48) if "residual" in fusion else None)
        # the compiled prologue is torch's to fp32 rounding, which may move a value across a bf16
        # step: each path multiplies what the compiled prologue and rounding give (layer.activations)
        rounded = layer.activations(x, kwargs["norm"], kwargs["gated"])
        torch.testing.assert_close(rounded, layer.activations(prologue(x, kwargs["norm"], kwargs["gated"])),
                                   rtol=2 ** -7, atol=rounded.abs().max().item() / ACTIVATION_LEVELS)
        want = reference(rounded, residual=kwargs["residual"])
        torch.testing.assert_close(layer(x, **kwargs), want, rtol=1e-4, atol=1e-4)  # the kernel
        batch = layer(x.repeat(30, 1), **{**kwargs, "residual": None if kwargs["residual"] is None
                                           else kwargs["residual"].repeat(30, 1)})  # the large-batch path
        torch.testing.assert_close(batch[:rows], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_kernel_and_gemm_round_activation_ties_alike(qtype):
    """A block whose max is ACTIVATION_LEVELS has scale 1: k + 0.5 is a tie, rounded to even by both."""
    torch.manual_seed(1)
    cols = _width(qtype, 2) if GGML_QUANT_SIZES[qtype][0] == BLOCK else _width(qtype, 1)
    layer = _layer(qtype, 16, cols, with_bias=False)
    x = (torch.arange(cols, dtype=torch.float32) * 257 % 16000 - 8000) + 0.5
    x[0], x[BLOCK] = ACTIVATION_LEVELS, -ACTIVATION_LEVELS
    x = x[None]
    assert torch.equal(quantize_activations(x)[0, 1:4], torch.round(x[0, 1:4]))
    close = dict(rtol=1e-6, atol=1e-2 * (cols / 64) ** 0.5)
    torch.testing.assert_close(layer(x), layer(x.repeat(BlockQuantLinear.DECODE_ROWS + 1, 1))[:1], **close)
    torch.testing.assert_close(layer.forward_kernel(x), layer.forward_gemm(x), **close)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_only_kernels_compute_bf16_activations_times_weights_rounded_to_their_grid(bits, with_bias):
    """The one-hot rows of the identity read the kernel's weights back: every weight within half a
    step of its grid (8 bits: max|row| / 127 per row; 4 bits: (max - min) / 15 per block of 32),
    and any input gives its bf16 rounding times those weights, in fp32 out, plus the bias."""
    torch.manual_seed(4)
    rows, cols = 48, 96
    weight = torch.randn(rows, cols) * torch.logspace(-2, 0, cols)
    bias = torch.randn(rows) if with_bias else None
    layer = WeightOnlyLinear(bits, weight, bias)
    offset = torch.zeros(rows) if bias is None else bias
    read = (layer(torch.eye(cols)) - offset).t()  # (rows, cols)
    if bits == 8:
        step = weight.abs().amax(1, keepdim=True) / 127
    else:
        blocks = weight.view(rows, -1, BLOCK)
        step = ((blocks.amax(-1) - blocks.amin(-1)) / 15).repeat_interleave(BLOCK, 1)
    # bf16 holds the scales and the read-back: a relative 2^-8 on top of the half step
    assert ((read - weight).abs() <= step / 2 * 1.02 + weight.abs() * 2 ** -8).all()
    x = torch.randn(5, cols)
    want = torch.nn.functional.linear(x.bfloat16().float(), read, bias)
    torch.testing.assert_close(layer(x), want, rtol=2e-2, atol=2e-2)
    assert layer(x).dtype == torch.float32
    residual = torch.randn(5, rows)
    torch.testing.assert_close(layer(x, residual=residual), residual + layer(x))


@pytest.mark.parametrize("mode", ["w8a16", "w4a16"])
def test_weight_only_modes_take_the_matmuls_their_kernels_fit(tmp_path, mode):
    """Input width 48 is no whole number of blocks: only `down` (64 in, 48 out: three packs of 16
    output channels for int4) runs quantized."""
    from tests.conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "m", hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64)
    loaded = load_model(EngineConfig.from_kwargs(model=model, quantization=mode).model)
    kinds = {name.split(".")[-1]: type(m) for name, m in loaded.model.named_modules()
             if isinstance(m, (Linear, WeightOnlyLinear))}
    assert kinds == {"qkv": Linear, "o": Linear, "gate_up": Linear, "down": WeightOnlyLinear, "lm_head": Linear}
    assert loaded.quantization == mode and loaded.quality is None  # a start scores nothing


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantized_blocks_are_ggufs_own_values_bit_for_bit(qtype):
    """Blocks fitted to weights and blocks of random bytes (every packed scale, min and high bit)."""
    torch.manual_seed(4)
    cols = _width(qtype, 3)
    fitted = quantize_blocks((torch.randn(37, cols) * 2).numpy(), qtype)
    drawn = random_blocks(qtype, 37, cols, np.random.default_rng(4))
    for blocks in (fitted, drawn):
        assert torch.equal(gguf_types.dequantize(blocks, qtype), torch.from_numpy(gguf_dequantize(blocks, qtype)))
        q, d, m = gguf_types.block_integers(blocks, qtype)  # what the large-batch GEMMs multiply
        weights = d.repeat_interleave(BLOCK, -1) * q.float() + (0 if m is None else m.repeat_interleave(BLOCK, -1))
        assert torch.equal(weights, gguf_types.dequantize(blocks, qtype))  # exact: d * sc takes no rounding
        assert np.array_equal(gguf_types.stored_blocks_of(gguf_types.kernel_rows(blocks, qtype), qtype), blocks)
    with pytest.raises(ValueError, match="do not run Q2_K"):
        gguf_types.dequantize(fitted, Q.Q2_K)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_a_layer_on_the_batch_kernels_makes_its_fp32_weights_only_when_they_are_read(qtype):
    """Where the tile or vector GEMM takes large batches, nothing reads fp32 weights: they are
    made on first use (a benchmark's or test's fp32 GEMM) from the kernel's rows, the blocks'
    own values, and kept."""
    torch.manual_seed(5)
    cols = _width(qtype, 3)
    blocks = quantize_blocks((torch.randn(64, cols) * 2).numpy(), qtype)
    layer = BlockQuantLinear([(qtype, blocks)], None, load_cpu_kernels())
    batch_kernel = layer.tiled or layer.vectored
    assert (layer.dense_weight is None) == batch_kernel
    if batch_kernel:
        assert sum(b.nbytes for b in layer.buffers()) < 4 * 64 * cols  # less than the fp32 weights alone
    assert torch.equal(layer.weight, gguf_types.dequantize(blocks, qtype))
    assert layer.dense_weight is layer.weight


def test_activation_rounding_error_is_half_a_step():
    x = torch.randn(5, 4 * BLOCK) * torch.logspace(-3, 3, 4 * BLOCK)
    step = x.view(5, 4, BLOCK).abs().amax(-1, keepdim=True) / ACTIVATION_LEVELS
    assert ((quantize_activations(x) - x).view(5, 4, BLOCK).abs() <= step / 2 * (1 + 1e-6)).all()


def test_the_compiled_rounding_is_the_torch_rounding_bit_for_bit():
    """The GEMM path rounds with the compiled kernels: ties, all-zero blocks and 70 rows (more
    than one thread's share) give exactly quantize_activations' values."""
    torch.manual_seed(4)
    x = torch.randn(70, 6 * BLOCK) * torch.logspace(-4, 4, 6 * BLOCK)
    x[0, :BLOCK] = torch.arange(BLOCK) * 97 + 0.5  # ties: the block's max is LEVELS, so its step is 1
    x[0, 0] = ACTIVATION_LEVELS
    x[1, :BLOCK] = 0
    assert torch.equal(load_cpu_kernels().kernel_activations(x, None, 0.0, False, False), quantize_activations(x))


def test_int8_keeps_matmuls_whose_width_is_not_a_multiple_of_the_block_in_fp32(tmp_path):
    from tests.conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "m", hidden_size=40, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64)
    loaded = load_model(EngineConfig.from_kwargs(model=model, quantization="int8").model)
    kinds = {name.split(".")[-1]: type(m) for name, m in loaded.model.named_modules()
             if isinstance(m, (Linear, BlockQuantLinear))}
    assert kinds == {"qkv": Linear, "o": Linear, "gate_up": Linear, "down": BlockQuantLinear, "lm_head": Linear}
    assert loaded.model.decode_stack is None  # the fused decode stack needs every layer matmul in blocks


def test_gguf_runs_the_files_own_blocks_which_are_the_fp32_models_weights():
    """The embedded GGUF: every matmul keeps its stored type (Q4_1 layers, Q8_0 tied LM head), and
    dequantized they are exactly the fp32 model's weights (q/k rows un-permuted, parts stacked)."""
    ref = load_model(ModelConfig(quantization="none"))
    quant = load_model(ModelConfig(quantization="gguf"))
    ref_weights = {name: m.weight for name, m in ref.model.named_modules() if isinstance(m, Linear)}
    quantized = {name: m for name, m in quant.model.named_modules() if isinstance(m, BlockQuantLinear)}
    assert quantized.keys() == ref_weights.keys()
    assert {qtype for name, m in quantized.items() if name != "lm_head" for qtype in m.qtypes} == {Q.Q4_1}
    assert quantized["lm_head"].qtypes == [Q.Q8_0]
    for name, m in quantized.items():
        assert torch.equal(m.weight, ref_weights[name]), name
    assert quant.weight_bytes_per_token < 0.2 * ref.weight_bytes_per_token


def _qwen3_gguf(tmp_path, qtype, types=None, intermediate_size: int = 512) -> str:
    """A tiny Qwen3 as GGUF (no q/k row permutation), every matmul's width a whole number of super-blocks."""
    from tests.conftest import save_tiny_model

    hf = save_tiny_model(tmp_path / "hf", "qwen3", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=128, intermediate_size=intermediate_size)
    return write_gguf(hf, str(tmp_path / f"{_name(qtype)}.gguf"), qtype, types)


def _q4_k_m(layers: int) -> dict:
    """llama-quantize's Q4_K_M choices on a model whose down projection is 384 wide (no whole
    super-block): v and the LM head in Q6_K, down in Q5_0, the rest Q4_K."""
    return {"output.weight": Q.Q6_K} | {f"blk.{i}.{part}.weight": qtype for i in range(layers)
                                        for part, qtype in (("attn_v", Q.Q6_K), ("ffn_down", Q.Q5_0))}


@pytest.mark.parametrize("kind", QTYPES + ["Q4_K_M"], ids=_name)
def test_a_gguf_file_of_each_type_runs_its_blocks_and_decodes_the_dequantized_models_tokens(kind, tmp_path):
    """A GGUF whose matmuls are all one type, and a Q4_K_M mix (q/k/v one matmul of Q4_K and Q6_K
    parts): every matmul runs the file's parts in their types, the decode stack on, and decodes the
    tokens of the fp32 model dequantized from the same file; teacher-forced on the shipped text, top-1
    agreement >= 99.5% where the reference leads by 0.2 logits and perplexity within 1%."""
    path = (_qwen3_gguf(tmp_path, Q.Q4_K, _q4_k_m(2), intermediate_size=384) if kind == "Q4_K_M"
            else _qwen3_gguf(tmp_path, kind))
    fp32 = LLM(path, quantization="none")
    blocks = LLM(path, quantization="gguf", quality_check_tokens=0)
    model = blocks.engine.loaded.model
    matmuls = {name: m for name, m in model.named_modules() if isinstance(m, (Linear, BlockQuantLinear))}
    assert all(isinstance(m, BlockQuantLinear) and not m.bf16_activations for m in matmuls.values())
    if kind == "Q4_K_M":  # one part a GGUF tensor
        assert matmuls["layers.0.qkv"].qtypes == [Q.Q4_K, Q.Q4_K, Q.Q6_K]
        assert [matmuls[f"layers.0.{n}"].qtypes for n in ("o", "mlp.gate_up", "mlp.down")] == [
            [Q.Q4_K], [Q.Q4_K, Q.Q4_K], [Q.Q5_0]]
        assert matmuls["lm_head"].qtypes == [Q.Q6_K]
    else:
        assert all(set(m.qtypes) == {kind} for m in matmuls.values())
    assert model.decode_stack is not None
    prompts = _prompts(4, seed=2)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in blocks.generate(prompts, greedy, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in fp32.generate(prompts, greedy, use_tqdm=False)])
    ref = fp32.engine.loaded
    ids = eval_tokens(ref.tokenizer, 1024)
    quality = compare(token_scores(ref.model, ids), token_scores(model, ids), min_margin=0.2)
    assert quality.top1_agreement >= 0.995 and abs(quality.perplexity_increase) <= 0.01, quality


def test_a_gguf_tensor_of_a_type_no_kernel_runs_is_re_quantized_to_int8_and_the_start_up_line_says_so(
        tmp_path, caplog):
    path = _qwen3_gguf(tmp_path, Q.Q4_K, {"blk.1.ffn_up.weight": Q.F16})
    with caplog.at_level("INFO"):
        llm = LLM(path, quantization="gguf", quality_check_tokens=0)
    layers = llm.engine.loaded.model.layers
    assert layers[1].mlp.gate_up.bf16_activations and layers[1].mlp.gate_up.qtypes == [Q.Q8_0]  # the int8 mode's
    assert layers[0].mlp.gate_up.qtypes == [Q.Q4_K, Q.Q4_K] and layers[1].mlp.down.qtypes == [Q.Q4_K]
    assert "matmuls gguf: 13 Q4_K, 1 int8" in caplog.text  # per part: q, k, v, o, gate, up, down, the LM head
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_gguf_mode_takes_gguf_files_only(tiny_llama):
    with pytest.raises(ValueError, match="runs a .gguf file's own blocks"):
        ModelConfig(model=tiny_llama, quantization="gguf")


def _quality(model: str, mode: str, num_tokens: int, min_margin: float):
    ref = load_model(EngineConfig.from_kwargs(model=model, quantization="none").model)
    quant = load_model(EngineConfig.from_kwargs(model=model, quantization=mode, quality_check_tokens=0).model)
    assert quant.weight_bytes_per_token < 0.3 * ref.weight_bytes_per_token
    ids = eval_tokens(ref.tokenizer, num_tokens)
    return compare(token_scores(ref.model, ids), token_scores(quant.model, ids), min_margin=min_margin)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_int8_quality_against_fp32_on_tiny_models(model, request):
    """Random models are nearly flat (perplexity in the thousands): top-1 agreement counts the
    positions whose reference argmax leads by at least 0.2 logits (their logits spread with std ~2.4)."""
    quality = _quality(request.getfixturevalue(model), "int8", 2048, min_margin=0.2)
    assert quality.top1_agreement >= 0.97, quality
    assert abs(quality.perplexity_increase) <= 0.03, quality


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "gguf", "w4a16"])
def test_quality_against_fp32_on_the_embedded_model(mode):
    """`cbserve check`'s figures, 6,000 tokens of the shipped text: top-1 agreement >= 97%,
    perplexity within 3%. (w8a16, one int8 scale per output channel, measures 96.6%: BENCHMARKS.md.)"""
    config = ModelConfig(quantization=mode)
    quality = quantization_check.check(config, mode, torch.float32)
    print(f"{mode} vs fp32: {quality}")
    assert quality.passes, quality
    quant, fp32 = load_model(config), load_model(ModelConfig(quantization="none"))
    assert quant.quality == quality  # read back by the next start
    assert quant.weight_bytes_per_token < 0.35 * fp32.weight_bytes_per_token


def test_quantization_config_refusals():
    ModelConfig(quantization="auto", device="cuda")  # fp32 there: the quantized kernels are CPU code
    ModelConfig(quantization="int8", quality_check_tokens=0)
    with pytest.raises(ValueError, match="runs on the CPU"):
        ModelConfig(quantization="w4a16", device="cuda")
    with pytest.raises(ValueError, match="computes in float32"):
        ModelConfig(quantization="w8a16", dtype="bfloat16")
    with pytest.raises(ValueError, match="quality_check_tokens"):
        ModelConfig(quality_check_tokens=-1)


def test_the_checks_figures_are_the_measured_quality_and_starts_read_them(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))  # w8a16 needs no compiled kernels there
    config = ModelConfig(model=tiny_llama, quantization="w8a16", quality_check_tokens=2048)
    assert load_model(config).quality is None  # never checked: a start scores nothing
    checked = quantization_check.check(config, "w8a16", torch.float32)
    ref, quant = load_model(ModelConfig(model=tiny_llama, quantization="none")), load_model(config)
    ids = eval_tokens(ref.tokenizer, 2048)
    assert checked == quant.quality == compare(token_scores(ref.model, ids), token_scores(quant.model, ids))
    [cached] = (tmp_path / "quality").glob("*w8a16*.json")
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "top1_agreement": 0.5}))
    assert load_model(config).quality.top1_agreement == 0.5
    other_length = load_model(ModelConfig(model=tiny_llama, quantization="w8a16", quality_check_tokens=1024))
    assert other_length.quantization == "w8a16" and other_length.quality is None


def test_through_an_fp16_cache_the_check_scores_through_it_and_the_report_carries_it(tiny_llama, tmp_path,
                                                                                      monkeypatch):
    """The check feeds the text in chunks that read the earlier tokens back from an fp16 cache, as
    the engine runs it; figures through each cache are cached apart, and the report carries them."""
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))  # w8a16 needs no compiled kernels there
    config = ModelConfig(model=tiny_llama, quantization="w8a16", quality_check_tokens=1024)
    through_fp16 = quantization_check.check(config, "w8a16", torch.float16)
    whole = quantization_check.check(config, "w8a16", torch.float32)
    ref, quant = load_model(ModelConfig(model=tiny_llama, quantization="none")), load_model(config)
    ids = eval_tokens(ref.tokenizer, 1024)
    want = compare(token_scores(ref.model, ids),
                   token_scores(quant.model, ids, kv_cache_dtype=torch.float16, chunk=KV_CHUNK))
    assert through_fp16 == want and whole == compare(token_scores(ref.model, ids), token_scores(quant.model, ids))
    assert whole != through_fp16  # not read back from the fp16 cache's figures
    assert len(list((tmp_path / "quality").glob("*w8a16*.json"))) == 2
    report = LLM(tiny_llama, quantization="w8a16", quality_check_tokens=1024, kv_cache_dtype="float16",
                 kv_cache_memory_bytes=1 << 20).engine.model_report
    assert (report.kv_cache_dtype, report.top1_agreement) == ("float16", want.top1_agreement)


def test_the_check_stays_within_a_short_max_model_len(tiny_llama, tmp_path, monkeypatch):
    """Windows shorter than the RoPE tables: 48 positions, where the default window is 256 tokens."""
    monkeypatch.setenv("CBSERVE_CACHE", str(tmp_path))
    short = dict(model=tiny_llama, max_model_len=48, quality_check_tokens=512)
    checked = quantization_check.check(ModelConfig(quantization="w8a16", **short), "w8a16", torch.float32)
    ref = load_model(ModelConfig(model=tiny_llama, max_model_len=48, quantization="none"))
    quant = load_model(ModelConfig(model=tiny_llama, max_model_len=48, quantization="w8a16"))
    ids = eval_tokens(ref.tokenizer, 512)
    assert checked == compare(token_scores(ref.model, ids, 48), token_scores(quant.model, ids, 48), 48)


def _same_alone_and_in_a_batch(model: str | None, mode: str, engine_args: dict, num_prompts: int, max_tokens: int):
    prompts = _prompts(num_prompts, seed=3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # alone, each prompt prefilled in the batch's chunks: a chunk of a few rows runs the decode
    # kernel and a whole long prompt the GEMM path, equal only to fp32 rounding (the kernel tests
    # check that), which flips near-ties of a random model's nearly flat logits
    alone = LLM(model=model, quantization=mode, max_num_seqs=1,
                max_num_batched_tokens=engine_args.get("max_num_batched_tokens", 512),
                kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto"))
    want = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(model=model, quantization=mode, **engine_args)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


SCHEDULER_FEATURES = [
    dict(max_num_seqs=64),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunked prefill
    dict(max_num_seqs=3, max_num_batched_tokens=7, block_size=4),
    dict(max_num_seqs=64, enable_prefix_caching=False),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"),
]


@pytest.mark.parametrize("engine_args", SCHEDULER_FEATURES)
@pytest.mark.parametrize("mode", ["int8", "w8a16", "w4a16"])
def test_greedy_is_the_same_alone_and_in_a_batch_under_every_scheduler_feature(tiny_llama, mode, engine_args):
    _same_alone_and_in_a_batch(tiny_llama, mode, engine_args, num_prompts=12, max_tokens=24)


@pytest.mark.parametrize("engine_args", SCHEDULER_FEATURES)
@pytest.mark.parametrize("mode", ["none", "int8"])
def test_an_fp16_kv_cache_keeps_greedy_the_same_alone_and_in_a_batch(tiny_llama, mode, engine_args):
    """A prompt attends to its keys as the cache rounds them whether it is prefilled whole, in
    chunks, or again after preemption (swap moves fp16 blocks; recompute writes them again)."""
    _same_alone_and_in_a_batch(tiny_llama, mode, {**engine_args, "kv_cache_dtype": "float16"}, num_prompts=12,
                               max_tokens=24)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_an_fp16_kv_cache_keeps_quality_against_fp32_on_tiny_models(model, request):
    """The text in chunks of 16 tokens, each reading the earlier ones back from an fp16 cache,
    against fp32 scored whole (as _quality counts agreement)."""
    ref = load_model(EngineConfig.from_kwargs(model=request.getfixturevalue(model)).model)
    ids = eval_tokens(ref.tokenizer, 1024)
    quality = compare(token_scores(ref.model, ids),
                      token_scores(ref.model, ids, kv_cache_dtype=torch.float16, chunk=16), min_margin=0.2)
    assert quality.top1_agreement >= 0.99, quality
    assert abs(quality.perplexity_increase) <= 0.005, quality


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunked prefill; decodes in batches of 8 and more
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"),
])
def test_gguf_greedy_is_the_same_alone_and_in_a_batch_on_the_embedded_model(engine_args):
    _same_alone_and_in_a_batch(None, "gguf", engine_args, num_prompts=10, max_tokens=12)


class _CountingStack:
    """Delegates to the model's compiled decode stack and records the steps it takes: their count,
    depths (layers), sizes (tokens) and arguments."""

    def __init__(self, stack):
        self.stack, self.calls, self.depths, self.sizes, self.steps = stack, 0, set(), [], []

    def forward(self, hidden, *args):
        self.calls += 1
        self.depths.add(args[-2])  # num_layers (then the rows' LoRA slots)
        self.sizes.append(hidden.shape[0])
        self.steps.append((hidden, *args))
        return self.stack.forward(hidden, *args)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])  # qwen2: biased q/k/v
def test_decode_steps_run_the_fused_stack_and_compute_what_the_layers_compute(model_fixture, kv_cache_dtype,
                                                                                request):
    """The same requests through the fused stack (decode steps) and through the layers' own
    modules (every step): the same kernels and roundings (an fp16 cache's too), so the same
    tokens and log-probabilities bit for bit."""
    model = request.getfixturevalue(model_fixture)
    prompts = _prompts(6, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    runs = {}
    for fused in (True, False):
        llm = LLM(model=model, quantization="int8", max_num_seqs=4, max_num_batched_tokens=32,
                  kv_cache_dtype=kv_cache_dtype)
        paged = llm.engine.loaded.model
        assert paged.decode_stack is not None
        counting = paged.decode_stack = _CountingStack(paged.decode_stack) if fused else None
        runs[fused] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if fused:
            assert counting.calls >= 19  # at least every decode step of the last request alone
    assert [(o.token_ids, o.logprobs) for o in runs[True]] == [(o.token_ids, o.logprobs) for o in runs[False]]


def test_a_team_of_more_threads_than_cores_computes_each_step_as_one_thread_does():
    """More threads than cores: threads lose their core mid-step, and the team's spin barrier
    waits them out (a waiter yields its core). Every replayed step is one thread's result, bit
    for bit."""
    llm = LLM(quantization="gguf", max_num_seqs=4)  # the embedded model's Q4_1 layers
    counting = llm.engine.loaded.model.decode_stack = _CountingStack(llm.engine.loaded.model.decode_stack)
    lengths = [2, 5, 9, 12]  # steps of four requests down to one
    llm.generate(_prompts(4, seed=5), [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
                 use_tqdm=False)
    steps = {args[0].shape[0]: args for args in counting.steps}
    assert sorted(steps) == [1, 2, 3, 4]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = {size: counting.stack.forward(*args) for size, args in steps.items()}
        torch.set_num_threads(2 * os.cpu_count() + 1)
        for _ in range(10):
            for size, args in steps.items():
                assert torch.equal(counting.stack.forward(*args), want[size]), size
    finally:
        torch.set_num_threads(threads)


_SLEEPS_PER_TOKEN = """
import glob, json
from engine import LLM, SamplingParams

def sleeps():  # voluntary context switches of this process's threads: each a wait for a lock or a wake-up
    total = 0
    for status in glob.glob("/proc/self/task/*/status"):
        with open(status) as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total

llm = LLM(quantization="gguf", num_threads=2)
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate([list(range(100, 132))], params, use_tqdm=False)
before = sleeps()
llm.generate([list(range(100, 132))], params, use_tqdm=False)
print(json.dumps((sleeps() - before) / 64))
"""


def test_the_stacks_threads_do_not_queue_on_malloc_when_the_process_has_one_arena():
    """A process with more threads than glibc makes malloc arenas (8 per core: a Ray driver's)
    shares them. The stack's threads quantized each matmul's input into fresh arrays and, sharing an
    arena, slept on its lock ~500 times a token at half the speed. They now reuse the arrays they
    freed (engine/csrc/scratch.cpp). With one arena for every thread (MALLOC_ARENA_MAX=1), a token
    costs the whole process a few sleeps at most."""
    result = subprocess.run([sys.executable, "-c", _SLEEPS_PER_TOKEN], capture_output=True, text=True, timeout=300,
                            env=os.environ | {"MALLOC_ARENA_MAX": "1"}, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    sleeps_per_token = json.loads(result.stdout.strip().splitlines()[-1])
    assert sleeps_per_token < 20, sleeps_per_token


def test_a_self_draft_of_a_quantized_target_drafts_through_the_stacks_first_layers(tiny_llama):
    """Self-draft passes are decode steps through the first layers: the stack runs them too, and
    the output is the target's own (int8 without speculation)."""
    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(model=tiny_llama, quantization="int8")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=tiny_llama, quantization="int8",
              speculative_config={"method": "self_draft", "num_layers": 1, "adaptive": False})
    paged = llm.engine.loaded.model
    counting = paged.decode_stack = _CountingStack(paged.decode_stack)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert 1 in counting.depths and llm.engine.get_stats().num_spec_proposed_tokens > 0
