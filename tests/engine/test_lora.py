"""LoRA adapters through the real loader: PEFT adapters made here over tiny random bases, greedy
outputs against PEFT's merged model in transformers (fp32), batches mixing adapters against each
request alone (fp32 and the quantized modes' kernels and decode stack), LRU eviction, the prefix
cache told apart per adapter, max_loras per step, speculation and beam search with adapters."""
from __future__ import annotations

import json

import pytest
import torch

from engine.beam_search import BeamSearchParams
from engine.cli import main as cli_main
from engine.config import EngineConfig
from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_model
from tests.engine.helpers import hf_greedy

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 8, 2, 41, 9], [12, 7, 7, 30, 21], [3, 44, 15, 9, 28, 6, 11, 19, 2], [40, 1, 22]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_adapter(base: str, path, seed: int, rank: int = 8, targets=ALL_PROJECTIONS, merged_to=None,
                 **lora_settings) -> str:
    """A PEFT LoRA adapter over `base` with random A and B (B scaled so its outputs differ from the
    base's), saved at `path`; with `merged_to`, PEFT's merged model saved there too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False, **lora_settings))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(path)
    if merged_to is not None:
        peft_model.merge_and_unload().save_pretrained(merged_to)
        AutoTokenizer.from_pretrained(base).save_pretrained(merged_to)
    return str(path)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Four adapters over tiny_llama: name -> (adapter dir, merged model dir)."""
    made = {}
    for seed, name in enumerate(["a", "b", "c", "d"]):
        root = tmp_path_factory.mktemp(f"lora-{name}")
        targets = ALL_PROJECTIONS if name != "c" else ["q_proj", "v_proj", "down_proj"]
        made[name] = (make_adapter(tiny_llama, root / "adapter", seed, targets=targets, merged_to=root / "merged"),
                      str(root / "merged"))
    return made


def lora_llm(base: str, adapters: dict[str, tuple[str, str]], **engine_args) -> LLM:
    return LLM(base, enable_lora=True, lora_modules=[f"{n}={path}" for n, (path, _) in adapters.items()],
               num_blocks=256, block_size=4, **engine_args)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "phi3"])
def test_greedy_with_an_adapter_equals_pefts_merged_model(arch, tmp_path):
    """Every family's layout (fused qkv and gate_up, biases, q/k norms, sandwich norms, Phi-3's
    stored-fused projections and partial rotary): an adapter's greedy tokens equal PEFT's merged
    model's in transformers, and differ from the base's."""
    base = save_tiny_model(tmp_path / "base", arch)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else ALL_PROJECTIONS
    adapter = make_adapter(base, tmp_path / "adapter", seed=1, targets=targets, merged_to=tmp_path / "merged")
    llm = LLM(base, enable_lora=True, lora_modules=[f"x={adapter}"], quantization="none")
    with_adapter = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora="x"))
    assert with_adapter == hf_greedy(str(tmp_path / "merged"), PROMPTS, 12, ignore_eos=True)
    assert with_adapter != tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_batch_mixing_adapters_and_the_base_equals_each_request_alone(tiny_llama, adapters, quantization):
    """Four adapters and the base in one batch (their rows grouped per adapter in each step, the
    decode stack's adapter slots in `int8`) give each request the tokens it gets alone."""
    llm = lora_llm(tiny_llama, adapters, quantization=quantization, quality_check_tokens=0)
    names = [None, "a", "b", "c", "d", "a", None, "d"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    together = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora=names))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False, lora=n))[0] for p, n in zip(prompts, names)]
    assert together == alone
    assert len({tuple(t) for t in together[:5]}) == 5  # each adapter changes the output
    if quantization == "int8":
        assert llm.engine.runner.model.decode_stack is not None  # the stack ran the adapters' decode steps


def test_quantized_base_with_an_adapter_tracks_the_fp32_adapter(tiny_llama, adapters):
    """The base quantized (`int8`), the adapter fp32: its greedy tokens follow the fp32 model's
    with the same adapter for most of the output (the base's quantization error alone apart)."""
    fp32 = tokens(lora_llm(tiny_llama, adapters, quantization="none").generate(PROMPTS, GREEDY, use_tqdm=False,
                                                                                lora="a"))
    int8 = tokens(lora_llm(tiny_llama, adapters, quantization="int8", quality_check_tokens=0).generate(
        PROMPTS, GREEDY, use_tqdm=False, lora="a"))
    agree = sum(x == y for a, b in zip(fp32, int8) for x, y in zip(a, b)) / sum(len(a) for a in fp32)
    assert agree >= 0.75


def test_least_recently_used_adapter_is_evicted_past_max_cpu_loras(tiny_llama, adapters):
    """With room for two adapters, using a third evicts the least recently used one; an evicted
    adapter loads again on its next request with the same outputs."""
    llm = lora_llm(tiny_llama, adapters, max_cpu_loras=2, max_loras=2)
    first = {n: tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora=n))[0] for n in ("a", "b")}
    held = llm.engine.adapters
    assert list(held.loaded) == ["a", "b"] and held.counters.evictions == 0
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="a")  # a is now the most recent
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="c")
    assert list(held.loaded) == ["a", "c"] and held.counters.evictions == 1
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="b"))[0] == first["b"]
    assert held.counters.loads == 4 and held.counters.evictions == 2


def test_at_most_max_loras_adapters_run_in_one_step(tiny_llama, adapters, monkeypatch):
    """max_loras 2: requests of four adapters all finish with their own outputs, and no step
    holds more than two adapters."""
    llm = lora_llm(tiny_llama, adapters, max_loras=2)
    engine = llm.engine
    seen = []
    launch = engine.runner.launch

    def spy(out, previous=None):
        seen.append({id(item.request.adapter) for item in out.scheduled if item.request.adapter is not None})
        return launch(out, previous)

    monkeypatch.setattr(engine.runner, "launch", spy)
    names = ["a", "b", "c", "d"]
    together = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora=names))
    monkeypatch.undo()
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False, lora=n))[0] for p, n in zip(PROMPTS, names)]
    assert together == alone
    assert max(len(s) for s in seen) == 2


def test_the_prefix_cache_is_not_shared_across_adapters(tiny_llama, adapters):
    """The same prompt under another adapter (or none) finds nothing cached; under the same one it does."""
    llm = lora_llm(tiny_llama, adapters)
    counters = llm.engine.scheduler.counters
    prompt = list(range(3, 40))

    def hits(lora):
        before = counters.num_prefix_hit_tokens
        llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)
        return counters.num_prefix_hit_tokens - before

    assert hits("a") == 0
    assert hits("b") == 0
    assert hits(None) == 0
    assert hits("a") > 0 and hits(None) > 0


def test_speculation_and_beam_search_run_with_adapters(tiny_llama, adapters):
    """n-gram speculation verifies drafts through the adapter: greedy tokens as without it; a beam
    search with an adapter equals transformers' beam search on PEFT's merged model."""
    from transformers import AutoModelForCausalLM

    plain = lora_llm(tiny_llama, adapters)
    spec = lora_llm(tiny_llama, adapters, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "adaptive": False})
    repeating = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    assert tokens(spec.generate(repeating, GREEDY, use_tqdm=False, lora="b")) == tokens(
        plain.generate(repeating, GREEDY, use_tqdm=False, lora="b"))
    assert spec.engine.scheduler.counters.spec.proposed > 0
    search = plain.generate(PROMPTS[:1], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True),
                            use_tqdm=False, lora="b")[0]
    merged = AutoModelForCausalLM.from_pretrained(adapters["b"][1], dtype=torch.float32)
    reference = merged.generate(torch.tensor(PROMPTS[:1]), num_beams=3, max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, early_stopping=True, pad_token_id=0)
    assert search.outputs[0].token_ids == reference[0, len(PROMPTS[0]):].tolist()


def test_adapters_are_found_under_adapter_dirs_and_fsspec_urls(tiny_llama, adapters, tmp_path):
    """A name not in lora_modules is looked up under adapter_dirs: a directory, or an fsspec URL
    (file://), copied once into the cache; an unknown name is AdapterNotFoundError."""
    import shutil

    shutil.copytree(adapters["a"][0], tmp_path / "dir" / "found")
    shutil.copytree(adapters["b"][0], tmp_path / "url" / "remote")
    llm = LLM(tiny_llama, enable_lora=True, adapter_dirs=[str(tmp_path / "dir"), f"file://{tmp_path / 'url'}"],
              num_blocks=256, block_size=4)
    reference = lora_llm(tiny_llama, adapters)
    for name, source in (("found", "a"), ("remote", "b")):
        assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora=name)) == tokens(
            reference.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora=source))
    with pytest.raises(AdapterNotFoundError, match="missing"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="missing")
    assert not llm.engine.has_unfinished_requests()


def test_adapters_that_do_not_fit_are_refused_with_the_reason(tiny_llama, adapters, tmp_path):
    """Over max_lora_rank, DoRA, and LoRA off: a clear error, the engine unchanged."""
    llm = lora_llm(tiny_llama, adapters, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="a")
    dora = make_adapter(tiny_llama, tmp_path / "dora", seed=5, use_dora=True)
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    assert config["use_dora"]
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"dora={dora}"], num_blocks=64, block_size=4)
    with pytest.raises(InvalidRequestError, match="DoRA"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="dora")
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))  # the engine goes on
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        LLM(tiny_llama, num_blocks=64, block_size=4).generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="a")
    with pytest.raises(ValueError, match="name=path"):
        EngineConfig.from_kwargs(enable_lora=True, lora_modules=["nopath"])


def test_the_command_line_generates_with_an_adapter(tiny_llama, adapters, capsys):
    """`cbserve generate --enable-lora --lora-modules a=PATH --lora a` prints the adapter's output."""
    text = lora_llm(tiny_llama, adapters).generate(["the cat"], SamplingParams(max_tokens=8, temperature=0),
                                                    use_tqdm=False, lora="a")[0].outputs[0].text
    assert cli_main(["generate", "--prompt", "the cat", "--max-tokens", "8", "--model", tiny_llama, "--enable-lora",
                     "--lora-modules", f"a={adapters['a'][0]}", "--lora", "a", "--num-blocks", "256",
                     "--block-size", "4"]) == 0
    assert capsys.readouterr().out.endswith(text + "\n")
