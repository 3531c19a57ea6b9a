"""The engine on CUDA (marked `gpu`: `make test-gpu` on a machine with an NVIDIA GPU).

float32 with the torch backend equals transformers on the same GPU token for token; bfloat16
(the CUDA default) with the Triton paged kernel (decode steps in CUDA graphs), the flash backend
(torch's FlashAttention-2 over gathered contexts) and the torch backend is as faithful to float32
as transformers' own bfloat16. Every scheduler feature is on in some run: chunked prefill with
cached context, prefix sharing, swap and recompute preemption. CUDA graphs on and off give the
same tokens (a graph step sends its block tables only as wide as its longest context; the graphs
of every bucket hold about the largest one's memory), and so do
async scheduling on and off; a decode's attention does not depend on how its context's partitions
are shared out; carrying the residual to the RMSNorm kernel changes no bit; swapping through the
side stream gives the tokens of a run that never swaps; the KV pool is sized from the GPU's
memory; no kernel compiles after start-up, whatever the steps' shapes.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.base import AttentionParams
from engine.runner.cuda_graphs import default_sizes
from tests.conftest import save_tiny_model
from tests.engine.helpers import assert_as_faithful_as_transformers, hf_greedy

pytestmark = pytest.mark.gpu

MAX_NEW = 24
FEATURES = [
    dict(max_num_seqs=64),
    dict(max_num_seqs=64, max_num_batched_tokens=16),  # chunks attend to cached context
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=32, preemption_mode="swap"),
    dict(num_blocks=40, block_size=4, max_num_batched_tokens=32, preemption_mode="recompute", policy="priority"),
]
FEATURE_IDS = ["batch64", "chunked16", "preempt-swap", "preempt-recompute"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """head_dim 64, as real models have (the flash kernel's tile sizes)."""
    return save_tiny_model(tmp_path_factory.mktemp("gpu-llama"), "llama", hidden_size=256, intermediate_size=512,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(40)]  # a common prefix: prefix-cache hits
    fresh = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 90))] for _ in range(10)]
    return fresh + [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))] for _ in range(6)]


def _greedy(llm: LLM, prompts, ignore_eos: bool = False) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=ignore_eos)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_pool(llm: LLM, args: dict) -> None:
    engine = llm.engine
    if "preemption_mode" in args:  # the small pool really forced preemptions
        stats = engine.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def _graph_replays(llm: LLM) -> int:
    return llm.engine.runner.graphs.replays if llm.engine.runner.graphs is not None else 0


@pytest.mark.parametrize("engine_args", FEATURES, ids=FEATURE_IDS)
def test_float32_greedy_equals_transformers_on_cuda(model_dir, prompts, engine_args):
    llm = LLM(model_dir, device="cuda", dtype="float32", **engine_args)
    assert llm.engine.runner.backend.name == "torch"  # flash attention has no float32 kernel
    assert _greedy(llm, prompts) == hf_greedy(model_dir, prompts, MAX_NEW, device="cuda")
    _check_pool(llm, engine_args)


@pytest.fixture(scope="module")
def bf16_reference(model_dir, prompts) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, MAX_NEW, device="cuda", dtype=torch.bfloat16, ignore_eos=True)


@pytest.mark.parametrize("backend", ["triton", "flash", "torch"])
@pytest.mark.parametrize("engine_args", FEATURES, ids=FEATURE_IDS)
def test_bfloat16_greedy_is_as_faithful_as_transformers_on_cuda(model_dir, prompts, bf16_reference, backend,
                                                               engine_args):
    llm = LLM(model_dir, device="cuda", attention_backend=backend, **engine_args)  # dtype auto: bfloat16
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.backend.name == backend
    outputs = _greedy(llm, prompts, ignore_eos=True)
    assert_as_faithful_as_transformers(model_dir, prompts, outputs, bf16_reference, device="cuda")
    _check_pool(llm, engine_args)
    assert (_graph_replays(llm) > 0) == (backend == "triton")  # decode steps replayed graphs


def test_auto_picks_the_paged_kernel_with_graphs_in_bfloat16_on_cuda(model_dir):
    llm = LLM(model_dir, device="cuda")
    runner = llm.engine.runner
    assert (runner.backend.name, runner.kv_cache.dtype) == ("triton", torch.bfloat16)
    assert runner.kv_cache.device.type == "cuda"
    assert runner.graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # max_num_seqs 64
    assert llm.engine.runs_ahead  # async scheduling


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("engine_args", FEATURES, ids=FEATURE_IDS)
def test_cuda_graphs_on_and_off_give_the_same_tokens(model_dir, prompts, dtype, engine_args):
    """The same engine with decode steps replayed from graphs (padded to their buckets) and run
    eagerly: the same greedy tokens, in float32 (full-precision products) and in bfloat16."""
    runs = {}
    for eager in (False, True):
        llm = LLM(model_dir, device="cuda", dtype=dtype, attention_backend="triton", enforce_eager=eager,
                  **engine_args)
        runs[eager] = _greedy(llm, prompts, ignore_eos=True)
        assert (_graph_replays(llm) > 0) != eager
        _check_pool(llm, engine_args)
    assert runs[False] == runs[True]


def test_the_decode_graphs_hold_about_the_largest_ones_memory(tmp_path):
    """Every bucket up to 256 rows is captured within twice the memory the 256-row graph takes
    alone: the graphs are captured largest first into one pool, each smaller one in the blocks
    the larger freed, and all write their logits to one buffer. (Captured smallest first with
    logits of their own, the 35 buckets' logits alone would take ~16x the largest's: 4,231 rows
    of a 32,000-token vocabulary.)"""
    model = save_tiny_model(tmp_path, "llama", vocab_size=32000, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    args = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_num_seqs=256, num_blocks=600)
    alone = LLM(model, cuda_graph_sizes=[256], **args)
    largest = alone.engine.runner.graphs.memory_bytes
    assert alone.engine.runner.graphs.sizes == [256] and largest > 0
    del alone
    gc.collect()
    torch.cuda.empty_cache()
    graphs = LLM(model, cuda_graph_memory_bytes=2 * largest, **args).engine.runner.graphs
    assert graphs.sizes == default_sizes(256)
    assert graphs.memory_bytes <= 2 * largest


def test_a_graph_step_sends_its_block_tables_only_as_wide_as_its_longest_row(model_dir):
    """A graph step copies block tables up to its longest context's blocks, not whole rows of
    max_model_len: what a longer request left past that stays in the graph's buffer, unread, and
    the short requests after it get the tokens of eager steps."""
    rng = random.Random(1)
    long_prompt = [rng.randrange(3, 300) for _ in range(100)]
    short = [[rng.randrange(3, 300) for _ in range(5)] for _ in range(3)]
    runs = {}
    for eager in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=eager,
                  block_size=4)
        runs[eager] = (_greedy(llm, [long_prompt], ignore_eos=True), _greedy(llm, short, ignore_eos=True))
        if not eager:
            graphs = llm.engine.runner.graphs
            wide, narrow = -(-(100 + MAX_NEW - 1) // 4), -(-(5 + MAX_NEW - 1) // 4)
            assert graphs.block_tables.shape[1] > wide  # rows of max_model_len / block_size entries
            assert (graphs.block_tables[0, narrow:wide] != graphs.sink_block).all()  # the long request's, unread
        _check_pool(llm, {})
    assert runs[False] == runs[True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_on_and_off_give_the_same_tokens(model_dir, prompts, dtype, eager):
    """Decode steps launched before the step before them is read (the default on CUDA), replayed
    from graphs or eager, give the tokens of an engine that waits for every step. Each request
    stops on a token of its own output, at steps spread over the run: the step launched for it
    is dropped, its batch-mates go on, and every block comes back."""
    def engine(async_scheduling: bool) -> LLM:
        return LLM(model_dir, device="cuda", dtype=dtype, attention_backend="triton", enforce_eager=eager,
                   async_scheduling=async_scheduling)

    reference = _greedy(engine(False), prompts, ignore_eos=True)
    stops = [tokens[3 + i % 12] for i, tokens in enumerate(reference)]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, stop_token_ids=[stop])
              for stop in stops]
    runs = {}
    for async_scheduling in (False, True):
        llm = engine(async_scheduling)
        runs[async_scheduling] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.engine.get_stats().num_steps_ahead > 0) == async_scheduling
        assert (_graph_replays(llm) > 0) != eager
        _check_pool(llm, {})
    assert runs[True] == runs[False]
    assert [len(t) for t in runs[True]] == [tokens.index(stop) + 1 for tokens, stop in zip(reference, stops)]


@pytest.mark.parametrize("engine_args", [dict(), dict(enforce_eager=True, max_num_batched_tokens=48)],
                         ids=["graphs", "eager-chunked"])
def test_no_kernel_compiles_after_start(tmp_path, engine_args):
    """Steps of every shape after start-up (batches of 1 to 9, contexts of 2 to 330 tokens, block
    tables 1 to 83 blocks wide, prefill chunks beside decodes) run kernels compiled at start-up:
    none compiles while requests wait. A model of its own shapes (head_dim 32, a GQA group of 3)
    so no other test's kernels count."""
    from engine.runner.model_runner import triton_variants

    model = save_tiny_model(tmp_path, "llama", hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2)
    llm = LLM(model, device="cuda", dtype="bfloat16", attention_backend="triton", num_blocks=512, block_size=4,
              **engine_args)
    compiled = triton_variants()
    rng = random.Random(1)
    lengths = [(1, 40), (3, 3), (17, 90), (64, 7), (65, 64), (150, 12), (300, 30), (33, 100), (5, 1)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n, _ in lengths]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [m for _, m in lengths]
    llm.generate(prompts[6:7], params[6:7], use_tqdm=False)  # a lone stream
    assert triton_variants() == compiled


def test_swap_through_the_side_stream_gives_the_tokens_of_a_run_without_swaps(model_dir, prompts):
    """A pool of 40 blocks of 4 tokens forces swap preemptions (blocks out to pinned host memory
    and back on the side stream); float32 makes every row's tokens independent of the batch."""
    common = dict(device="cuda", dtype="float32", attention_backend="triton", block_size=4,
                  max_num_batched_tokens=32)
    swapped = LLM(model_dir, num_blocks=40, preemption_mode="swap", **common)
    roomy = LLM(model_dir, num_blocks=4000, **common)
    assert _greedy(swapped, prompts, ignore_eos=True) == _greedy(roomy, prompts, ignore_eos=True)
    stats = swapped.engine.get_stats()
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in > 0
    assert roomy.engine.get_stats().num_preemptions_swap == 0
    _check_pool(swapped, {})


def test_the_kv_pool_is_sized_from_gpu_memory(model_dir):
    """With no kv_cache_memory_bytes, the pool is what gpu_memory_utilization leaves: raising it by
    2% of the card adds that many bytes of blocks (both under the max_num_seqs cap); a fraction
    that leaves nothing is refused, saying why."""
    args = dict(device="cuda", max_num_seqs=4096, max_model_len=2048, enforce_eager=True)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fraction = (total - free + 256 * 2**20) / total  # about 256 MiB beyond what is in use now
    blocks = {}
    for extra in (0.0, 0.02):
        engine = LLM(model_dir, gpu_memory_utilization=fraction + extra, **args).engine
        blocks[extra] = engine.kv.pool.num_blocks
        block_bytes = engine.runner.kv_cache[:, :, :1].numel() * engine.runner.kv_cache.element_size()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    added = (blocks[0.02] - blocks[0.0]) * block_bytes
    assert blocks[0.0] > 0 and abs(added - 0.02 * total) < 0.002 * total, (blocks, block_bytes, total)
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        LLM(model_dir, gpu_memory_utilization=0.001, **args)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (32, 8, 64), (8, 2, 128)])
def test_the_paged_kernel_agrees_with_the_gather_fallback(block_size, heads, kv_heads, head_dim):
    """The Triton kernel reading blocks in place against the flash backend's gather and
    FlashAttention-2 on one ragged bfloat16 batch (decodes, chunks with cached context, a first
    chunk), both against float32 attention."""
    from engine.attention.selector import select_backend
    from tests.engine.helpers import attention_case, expected_attention, run_attention

    device = torch.device("cuda")
    shapes = [(13, 1), (2, 1), (300, 1), (77, 1), (0, 90), (40, 70), (200, 17)]
    case = attention_case(block_size + heads, shapes, block_size, heads, kv_heads, head_dim, device)
    outputs = {name: run_attention(select_backend(name, device, torch.bfloat16, AttentionParams(case.scale),
                                                  max_model_len=2048), case, torch.bfloat16, device)
               for name in ("triton", "flash")}
    for (rows, expected), s in zip(expected_attention(case, torch.bfloat16), case.scheduled):
        for name, out in outputs.items():
            error = (out[rows] - expected).norm() / expected.norm()
            assert error < 1e-2, (name, s.start_pos, len(s.token_ids), error.item())
        paged_vs_gather = (outputs["triton"][rows] - outputs["flash"][rows]).norm() / expected.norm()
        assert paged_vs_gather < 1e-2, (s.start_pos, len(s.token_ids), paged_vs_gather.item())


def test_sampling_on_cuda_is_seeded_and_batch_independent(model_dir, prompts):
    """Every sampling setting runs on the GPU's tensors; a seeded request's tokens do not depend
    on its batch-mates (float32 here: in bfloat16 a batch's shape may move a near tie); top_k=1
    is greedy."""
    llm = LLM(model_dir, device="cuda", dtype="float32")
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=7,
                            repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, logprobs=3,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([prompts[0]] + prompts[1:6], [seeded] + [others] * 5, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    assert len(alone.logprobs) == 16 and all(len(lp) >= 3 for lp in alone.logprobs)
    llm = LLM(model_dir, device="cuda")
    top1 = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=1, ignore_eos=True)
    sampled = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], top1, use_tqdm=False)]
    assert sampled == _greedy(llm, prompts[:4], ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_kernels_round_as_the_torch_ops_do(dtype):
    """RMSNorm (with the residual add before it), SwiGLU and RoPE with the KV write, each one
    Triton kernel, round as the torch ops they replace (tests/engine/helpers.py)."""
    from tests.engine.helpers import check_fused_kernels

    check_fused_kernels(torch.device("cuda"), dtype)


def test_a_decodes_attention_does_not_depend_on_how_many_programs_share_its_partitions():
    """The decode kernel splits each context into partitions (flash-decoding); a CUDA graph's
    padded bucket and an eager step give a decode different program counts and partial-result
    sizes, so both must give the same bits. Long contexts: many partitions each."""
    from engine.attention.selector import select_backend
    from engine.runner.inputs import build_inputs
    from tests.engine.helpers import decode_outputs_however_split, ragged_batch

    block_size, heads, kv_heads, head_dim, device = 16, 32, 8, 64, torch.device("cuda")
    shapes = [(1500, 1), (700, 1), (63, 1), (64, 1), (5, 1)]
    num_blocks = sum(-(-(a + b) // block_size) for a, b in shapes) + 4
    inputs = build_inputs(ragged_batch(0, shapes, num_blocks, block_size), block_size, device)
    backend = select_backend("triton", device, torch.bfloat16, AttentionParams(head_dim ** -0.5), max_model_len=4096)
    cache = backend.allocate_kv_cache(1, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, device)[0]
    cache.normal_()
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(len(shapes), heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(len(shapes), kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    metadata = backend.build_metadata(inputs)
    assert metadata.decodes.parts == -(-1501 // backend.partition) > 1
    outputs = decode_outputs_however_split(backend, q, k, v, cache, metadata)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (3, 49152), (1, 1000), (200, 49152)])
def test_greedy_tokens_are_the_first_maximum_as_argmax_gives(rows, vocab):
    """The two-pass argmax of a few rows on CUDA (pieces, then their maxima) against torch's, with
    many ties, whose first index must win."""
    from engine.sampler import greedy_tokens

    gen = torch.Generator("cuda").manual_seed(rows)
    for _ in range(20):
        logits = torch.randint(-3, 4, (rows, vocab), device="cuda", generator=gen).float()
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_carrying_the_residual_to_the_norm_kernel_changes_no_bit(model_dir, prompts):
    """A 16-bit model on CUDA adds each residual in the next RMSNorm's kernel: its logits are the
    bits of the layers' own order (the add, then the norm), prefill and decode."""
    from engine.models import decoder

    llm = LLM(model_dir, device="cuda", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, seed=0)
    model, logits = llm.engine.runner.model, {True: [], False: []}
    original = decoder.fused_ops
    for carried, captured in logits.items():
        hook = model.register_forward_hook(lambda module, args, out, c=captured: c.append(out.clone()))
        decoder.fused_ops = original if carried else (lambda x: None)
        try:
            llm.generate(prompts[:3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        finally:
            decoder.fused_ops = original
            hook.remove()
    assert len(logits[True]) == len(logits[False]) > 1
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))
