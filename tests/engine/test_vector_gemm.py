"""The vector GEMM (engine/csrc/vector_gemm.cpp), the large-batch path of CPUs without AMX tiles,
in every build this CPU runs: the native one (this CPU's own branch: AVX512-VNNI and BF16 on the
EPYCs, AVX2 on older ones) and the matmul kernels built for older families (cpu_kernels.TARGETS:
AVX-512 without VNNI or BF16, AVX2, the plain loops). Each computes fp32 GEMM of the dequantized
weights on the rounded activations, with the prologue and residual fusions, each row the same bits
in any batch; the decode kernel of the same build computes the same values, its rows too the same
bits in any batch. Every GGUF type the kernels run, on random valid blocks (each byte drawn at
random, the fp16 scales of a weight's size), against fp32 GEMM of gguf's dequantization."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine import LLM, SamplingParams
from engine.cpu_kernels import TARGETS, cpu_flags, load_cpu_kernels, runnable_targets
from engine.models import gguf_types
from engine.models.linear import GATED_ACTIVATIONS, BlockQuantLinear, int8_blocks
from tests.engine.gguf_files import random_blocks
from tests.engine.test_parity import _prompts
from tests.engine.test_quantization import KINDS, _CountingStack, _name, _width

BUILDS = ["native"] + runnable_targets()
ROWS = (1, 2, 5, 9, 16, 33, 64, 70, 128, 257, 512)


def _expected_isa(build: str) -> str:
    flags = set(cpu_flags().split()) if build == "native" else TARGETS[build][1]
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512_vnni" if "avx512_vnni" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "plain"


class _Weights:
    """One matmul's weights of a kind: the rows the decode kernel and the vector GEMM read, and the
    dequantized fp32 values (the reference)."""

    def __init__(self, kind, rows: int, cols: int, with_bias: bool):
        self.bf16 = kind == "int8"
        if self.bf16:
            parts = [(GGMLQuantizationType.Q8_0, int8_blocks(torch.randn(rows, cols) * 0.05))]
        else:
            parts = [(kind, random_blocks(kind, rows, cols, np.random.default_rng(rows + cols)))]
        self.layer = BlockQuantLinear(parts, torch.randn(rows) if with_bias else None, load_cpu_kernels(),
                                      bf16_activations=self.bf16)
        self.weight = gguf_types.dequantize(parts[0][1], parts[0][0])

    def activations(self, x, norm=None, gated=None, kernels=None):
        """The rounded prologue the reference multiplies: the layer's (the engine's build), or that of
        `kernels`, the build under test: each build's own exp can put a value on the other side of a
        rounding step from another's."""
        if kernels is None:
            return self.layer.activations(x, norm, gated)
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        return kernels.kernel_activations(x.contiguous(), norm_weight, eps, GATED_ACTIVATIONS.get(gated, 0), self.bf16)

    def want(self, x, norm=None, gated=None, residual=None, kernels=None):
        out = torch.nn.functional.linear(self.activations(x, norm, gated, kernels), self.weight, self.layer.bias)
        return out if residual is None else residual + out

    def assert_close(self, got, x, norm=None, gated=None, residual=None, sums_apart: float = 1.0, kernels=None):
        """got within fp32 summation error of want: 2^-17 (2^-15 where `sums_apart`, another order of
        summing, is 4) of the sum of the products' magnitudes, which a wrong weight, scale or block
        passes by orders of magnitude."""
        magnitude = torch.nn.functional.linear(self.activations(x, norm, gated, kernels).abs(), self.weight.abs())
        error = (got - self.want(x, norm, gated, residual, kernels)).abs()
        assert (error <= 2 ** -17 * sums_apart * magnitude + 1e-6).all(), (error / magnitude).max()

    def vector(self, kernels, x, norm=None, gated=None, residual=None):
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        return kernels.vector_gemm(x, self.layer.part_rows, self.layer.formats, self.layer.bias, norm_weight, eps,
                                   GATED_ACTIVATIONS.get(gated, 0), residual)


@pytest.fixture(scope="module", params=BUILDS)
def kernels(request):
    built = load_cpu_kernels() if request.param == "native" else load_cpu_kernels(request.param, matmuls_only=True)
    assert built is not None, f"the {request.param} build failed (see the log)"
    assert built.vector_gemm_isa() == _expected_isa(request.param)
    return built


@pytest.mark.parametrize("kind", KINDS, ids=_name)
# (N, K blocks): a pass of 3 vectors, tails of 1 and 2; 3 to 48 blocks
@pytest.mark.parametrize("shape", [(48, 3), (80, 5), (16, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_vector_gemm_computes_fp32_gemm_of_the_dequantized_weights_each_row_the_same_bits_in_any_batch(
        kernels, kind, shape, with_bias):
    torch.manual_seed(1)
    shape = (shape[0], _width(kind, shape[1]))
    w = _Weights(kind, *shape, with_bias)
    batch = torch.randn(max(ROWS), shape[1]) * torch.logspace(-2, 2, shape[1])
    if w.bf16 and not kernels.vector_gemm_bf16():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            w.vector(kernels, batch[:9])
        return
    residual = torch.randn(max(ROWS), shape[0])
    whole = w.vector(kernels, batch, residual=residual)
    for rows in ROWS:
        x = batch[:rows]
        got = w.vector(kernels, x)
        w.assert_close(got, x)
        decoded = kernels.block_quant_linear(x, w.layer.part_rows, w.layer.formats, w.layer.bias, None, 0.0, 0, None)
        w.assert_close(decoded, x, sums_apart=4)  # the decode kernel, summing in another order
        alone = kernels.block_quant_linear(x[-1:], w.layer.part_rows, w.layer.formats, w.layer.bias, None, 0.0, 0,
                                           None)
        assert torch.equal(alone, decoded[-1:])  # its rows too the same bits in any batch
        assert torch.equal(w.vector(kernels, x, residual=residual[:rows]), whole[:rows])
        assert torch.equal(w.vector(kernels, batch[rows - 1:rows])[0], got[-1])  # alone
    shifted = w.vector(kernels, batch[7:300], residual=residual[7:300])  # other rows around it, other row tiles
    assert torch.equal(shifted, whole[7:300])


def test_the_vector_gemm_reads_a_fused_matmuls_parts_each_in_its_own_type(kernels):
    """A q/k/v-like matmul whose parts a Q4_K_M file stores in Q4_K and Q6_K, and a Q4_1 part (the
    regrouped rows), with passes that straddle the parts: each column unpacked from its own part."""
    rng = np.random.default_rng(5)
    parts = [(GGMLQuantizationType.Q4_K, random_blocks(GGMLQuantizationType.Q4_K, 32, 512, rng)),
             (GGMLQuantizationType.Q6_K, random_blocks(GGMLQuantizationType.Q6_K, 16, 512, rng)),
             (GGMLQuantizationType.Q4_1, random_blocks(GGMLQuantizationType.Q4_1, 48, 512, rng))]
    layer = BlockQuantLinear(parts, None, load_cpu_kernels())
    weight = torch.cat([gguf_types.dequantize(blocks, qtype) for qtype, blocks in parts])
    x = torch.randn(70, 512)
    got = kernels.vector_gemm(x, layer.part_rows, layer.formats, None, None, 0.0, 0, None)
    activations = kernels.kernel_activations(x, None, 0.0, 0, False)
    magnitude = torch.nn.functional.linear(activations.abs(), weight.abs())
    error = (got - torch.nn.functional.linear(activations, weight)).abs()
    assert (error <= 2 ** -17 * magnitude + 1e-6).all(), (error / magnitude).max()


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@pytest.mark.parametrize("fusion", ["norm", "silu", "gelu_tanh"])
def test_the_vector_gemms_fused_prologue_and_residual_compute_what_the_torch_ops_compute(kernels, kind, fusion):
    torch.manual_seed(2)
    cols = _width(kind, 5)
    w = _Weights(kind, 48, cols, with_bias=True)
    if w.bf16 and not kernels.vector_gemm_bf16():
        return  # refused, as the test above checks
    norm = (torch.rand(cols) + 0.5, 1e-5) if fusion == "norm" else None
    gated = None if fusion == "norm" else fusion
    x = torch.randn(37, 2 * cols if gated else cols)
    residual = torch.randn(37, 48)
    w.assert_close(w.vector(kernels, x, norm, gated, residual), x, norm, gated, residual, kernels=kernels)


def test_layers_past_their_decode_rows_run_the_vector_gemm_where_the_cpu_has_no_amx():
    """Where the native build has a vector branch and no AMX tiles, a block-quantized matmul takes
    the vector GEMM past VECTOR_DECODE_ROWS (the same bits as calling it), the decode kernel up to
    it; a model whose matmuls all do runs decode steps of any size through the fused stack."""
    kernels = load_cpu_kernels()
    w = _Weights(GGMLQuantizationType.Q4_1, 48, 96, with_bias=False)
    vector_branch = kernels.vector_gemm_isa() != "plain" and not kernels.block_quant_gemm_available()
    assert w.layer.vectored == vector_branch
    if not vector_branch:
        return
    assert w.layer.decode_rows == BlockQuantLinear.VECTOR_DECODE_ROWS
    x = torch.randn(BlockQuantLinear.VECTOR_DECODE_ROWS + 1, 96)
    assert torch.equal(w.layer(x), w.vector(kernels, x))
    assert torch.equal(w.layer(x[:-1]), w.layer.forward_kernel(x[:-1]))


def test_decode_steps_past_the_kernels_rows_run_the_stack_and_compute_what_the_layers_compute(tiny_llama):
    """Decode steps of more rows than the decode kernel takes go through the fused stack on the
    vector GEMM (where the CPU has no AMX and the build has bf16 products), the same tokens and
    log-probabilities bit for bit as the layers' own modules."""
    prompts = _prompts(BlockQuantLinear.VECTOR_DECODE_ROWS + 4, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for fused in (True, False):
        llm = LLM(model=tiny_llama, quantization="int8", max_num_seqs=len(prompts), max_num_batched_tokens=64)
        paged = llm.engine.loaded.model
        vectored = all(m.vectored for layer in paged.layers
                       for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down))
        kernels = load_cpu_kernels()
        assert vectored == (kernels.vector_gemm_bf16() and not kernels.block_quant_gemm_available()
                            and kernels.vector_gemm_isa() != "plain")
        counting = paged.decode_stack = _CountingStack(paged.decode_stack) if fused else None
        runs[fused] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if fused and vectored:
            assert max(counting.sizes) > BlockQuantLinear.VECTOR_DECODE_ROWS
    assert [(o.token_ids, o.logprobs) for o in runs[True]] == [(o.token_ids, o.logprobs) for o in runs[False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_slots_add_each_rows_adapter_delta_in_every_build(kernels, dtype):
    """engine/csrc/lora.cpp in each build: every row gets its own adapter's s B (A x) on the output
    columns its parts write (rows of none unchanged), as torch's grouped products give it, for a
    few rows (shrink and expand split among threads) and many (blocks of one adapter's rows)."""
    from engine.lora import LoraMatmul

    gen = torch.Generator().manual_seed(3)
    k, n, parts = 96, 160, [(0, 64), (64, 48), (112, 48)]
    slots, matmuls = kernels.LoraSlots(2), {}
    for slot, (rank, chosen) in enumerate([(8, [0, 1, 2]), (16, [1]), (4, [0, 2])]):
        segments = tuple((j * rank, rank, *parts[p]) for j, p in enumerate(chosen))
        matmuls[slot] = LoraMatmul((torch.randn(rank * len(chosen), k, generator=gen) * 0.1).to(dtype), segments,
                                   tuple((torch.randn(rank, parts[p][1], generator=gen) * 0.1).to(dtype)
                                         for p in chosen))
        slots.set(slot, 1, 0, matmuls[slot].a, list(matmuls[slot].b), torch.tensor(segments), n)
    for rows in (1, 3, 64):
        row_slots = torch.randint(-1, 3, (rows,), generator=gen)
        x = torch.randn(rows, k, generator=gen)
        base = torch.randn(rows, n, generator=gen)
        want = base.clone()
        for slot, m in matmuls.items():
            m.add(x, want, (row_slots == slot).nonzero().flatten())
        got = base.clone()
        slots.add(1, 0, x, got, row_slots)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[row_slots == -1], base[row_slots == -1])
