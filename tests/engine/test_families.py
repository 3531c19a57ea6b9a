"""The model families: every native family (engine/models/families.py) and the architectures that
run through transformers' own modeling code decode transformers' greedy tokens, token for token,
under chunked prefill, prefix caching, forced preemption and n-gram speculation; experts route as
transformers' own layer does; what cannot run is refused at load time, saying why."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.models.families import FAMILIES
from engine.models.mlp import Experts
from tests.conftest import NATIVE_ARCHS, TINY_ARCHS, TRANSFORMERS_ARCHS, save_tiny_model
from tests.engine.helpers import hf_greedy

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def shared_prefix_prompts(num: int = 8, seed: int = 0) -> list[list[int]]:
    """Prompts that start with parts of one prefix (the prefix cache serves their blocks), then differ."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(20)]
    return [prefix[:rng.randint(5, 20)] + [rng.randrange(3, 300) for _ in range(rng.randint(3, 40))]
            for _ in range(num)]


@pytest.fixture(scope="module", params=NATIVE_ARCHS + TRANSFORMERS_ARCHS)
def family(request, tmp_path_factory):
    """(arch, checkpoint, prompts, transformers' greedy tokens)."""
    model = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    prompts = shared_prefix_prompts()
    return request.param, model, prompts, hf_greedy(model, prompts, MAX_NEW)


SCHEDULING = {  # a 32-token step budget, prefix caching on, a pool small enough to preempt
    "swap+ngram": dict(preemption_mode="swap", speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "recompute+torch-attention": dict(preemption_mode="recompute", attention_backend="torch"),
}


@pytest.mark.parametrize("scheduling", list(SCHEDULING))
def test_greedy_matches_transformers_under_every_scheduling_feature(family, scheduling):
    arch, model, prompts, expected = family
    probe = LLM(model, quantization="none", num_blocks=8)
    groups = probe.engine.kv.layout.num_groups  # each group's blocks are a share of a block's memory
    llm = LLM(model, quantization="none", max_num_batched_tokens=32, block_size=4, num_blocks=40 * groups,
              enable_prefix_caching=True, **SCHEDULING[scheduling])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0  # the small pool really preempted
    assert stats.prefix_cache_hit_rate > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    report = llm.engine.model_report
    assert report.architecture == TINY_ARCHS[arch][1]
    assert report.model_path == ("native" if arch in NATIVE_ARCHS else "transformers")


def test_every_native_architecture_has_a_tiny_checkpoint_in_the_matrix():
    assert {TINY_ARCHS[arch][1] for arch in NATIVE_ARCHS} == set(FAMILIES)
    assert not {TINY_ARCHS[arch][1] for arch in TRANSFORMERS_ARCHS} & set(FAMILIES)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "phi3"])
def test_self_drafting_beam_search_and_structured_outputs_run_on_new_families(arch, tmp_path):
    """Self-drafting keeps transformers' greedy tokens; a beam search returns transformers' beams
    (generate with num_beams); a grammar-constrained request keeps to its grammar; no block leaks."""
    from engine.beam_search import BeamSearchParams
    from engine.sampling_params import StructuredOutputsParams

    model = save_tiny_model(tmp_path / arch, arch)
    prompts = shared_prefix_prompts(4, seed=2)
    expected = hf_greedy(model, prompts, MAX_NEW, ignore_eos=True)
    llm = LLM(model, quantization="none", speculative_config={"method": "self_draft", "num_layers": 1,
                                                              "num_speculative_tokens": 3})
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    assert llm.engine.get_stats().num_spec_proposed_tokens > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    for prompt, found in zip(prompts[:2], llm.beam_search(prompts[:2], BeamSearchParams(3, 8))):
        ids = torch.tensor([prompt])
        rows = hf.generate(ids, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=8,
                           attention_mask=torch.ones_like(ids))[:, len(prompt):].tolist()
        want = [row[:row.index(eos) + 1] if eos in row else row for row in rows]  # each row padded after its EOS
        assert [o.token_ids for o in found.outputs] == want
    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "ba"]))
    (out,) = llm.generate(["x"], choice, use_tqdm=False)
    assert out.outputs[0].text in ("ab", "ba")
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_experts_route_and_mix_as_transformers_own_layer(arch, tmp_path):
    """The paged model's experts against transformers' sparse MoE block on the same tokens: the
    same top-k experts and weights, the same output to fp32 rounding."""
    model_dir = save_tiny_model(tmp_path / arch, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, quantization="none")
    layer = next(i for i, paged in enumerate(llm.engine.loaded.model.layers) if isinstance(paged.mlp, Experts))
    ours, theirs = llm.engine.loaded.model.layers[layer].mlp, hf.model.layers[layer].mlp
    x = torch.randn(37, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, their_weights, their_experts = theirs.gate(x)
    experts, weights = ours.route(x)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-5, atol=1e-5)


def test_a_lone_token_runs_only_its_routed_experts(tmp_path):
    model_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe")
    mlp = next(layer.mlp for layer in LLM(model_dir, quantization="none").engine.loaded.model.layers
               if isinstance(layer.mlp, Experts))
    calls = []
    for index, expert in enumerate(mlp.experts):
        expert.register_forward_hook(lambda module, args, out, i=index: calls.append((i, args[0].shape[0])))
    x = torch.randn(1, mlp.router.shape[1])
    chosen, _ = mlp.route(x)
    mlp(x)
    assert sorted(i for i, _ in calls) == sorted(chosen[0].tolist()) and all(rows == 1 for _, rows in calls)
    calls.clear()
    batch = torch.randn(50, mlp.router.shape[1])
    mlp(batch)  # each expert at most once a step, over all its tokens
    assert len(calls) == len({i for i, _ in calls}) and sum(rows for _, rows in calls) == 50 * mlp.top_k


@pytest.mark.parametrize("config_name,model_name,fields,reason", [
    ("MambaConfig", "MambaForCausalLM", dict(hidden_size=32, num_hidden_layers=2, state_size=4),
     "without standard attention"),
    ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=2,
        num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8), "without standard attention"),
])
def test_models_that_cannot_take_the_paged_attention_are_refused_at_load_time(tmp_path, config_name, model_name,
                                                                              fields, reason):
    from tests.conftest import build_tokenizer

    tokenizer = build_tokenizer()
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **fields)
    getattr(transformers, model_name)(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=reason):
        LLM(str(tmp_path), quantization="none")


def test_model_impl_chooses_the_path_and_native_refuses_an_architecture_without_a_family(tiny_llama, tmp_path):
    """A native family forced through transformers' code decodes the same tokens (the path the
    benchmark sets against native); 'native' for an architecture without a family is refused."""
    prompts = shared_prefix_prompts(4, seed=5)
    expected = hf_greedy(tiny_llama, prompts, MAX_NEW)
    llm = LLM(tiny_llama, quantization="none", model_impl="transformers", max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.model_report.model_path == "transformers"
    with pytest.raises(UnsupportedModelError, match="no native family"):
        LLM(save_tiny_model(tmp_path / "gpt2", "gpt2"), quantization="none", model_impl="native")
