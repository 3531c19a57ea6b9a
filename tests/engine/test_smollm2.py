"""The embedded default model: greedy parity with transformers on chat prompts."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_loader import load_hf
from engine.tokenization import encode_chat

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.mark.slow
def test_embedded_model_matches_transformers_on_chat_prompts():
    llm = LLM(max_num_batched_tokens=16, max_num_seqs=8)  # chunked prefill on: chunks < prompt lengths
    outputs = llm.chat(CHATS, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    hf_model, tokenizer = load_hf(None)
    for chat, out in zip(CHATS, outputs):
        prompt = out.prompt_token_ids
        assert prompt == encode_chat(llm.tokenizer, chat) and len(prompt) > 16
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        eos = tokenizer.eos_token_id
        ref = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
def test_the_engines_reading_of_the_gguf_is_transformers_reading():
    """Each tensor the engine dequantizes from the mapped file, one at a time, is the one
    transformers' GGUF loader makes (bit for bit); the config, generation config, tokenizer and
    chat template kept from the file's metadata are those transformers reads from the file."""
    import os

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.model_loader import default_model_path, gguf_metadata
    from engine.models.gguf_blocks import MappedGGUF, tensor_table

    direct, direct_tokenizer = load_hf(None)
    directory, gguf_file = os.path.split(default_model_path())
    kept = gguf_metadata(default_model_path())
    config = AutoConfig.from_pretrained(kept)
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    got = MappedGGUF(default_model_path(), config, tensor_table(default_model_path())).state_dict(skeleton, set())
    want = {k: v for k, v in direct.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert config.tie_word_embeddings == direct.config.tie_word_embeddings
    assert GenerationConfig.from_pretrained(kept).eos_token_id == direct.generation_config.eos_token_id
    tokenizer = AutoTokenizer.from_pretrained(kept)
    assert direct_tokenizer.chat_template == tokenizer.chat_template
    text = "Hello, wörld! 12345 <|im_start|>user\nok"
    assert direct_tokenizer.encode(text) == tokenizer.encode(text)
    assert direct_tokenizer.apply_chat_template(CHATS[1]) == tokenizer.apply_chat_template(CHATS[1])
    assert sum(f.stat().st_size for f in kept.iterdir()) < 10e6  # what the cache keeps of the model: metadata


@pytest.mark.slow
def test_loading_the_gguf_fills_no_weight_at_random(monkeypatch):
    """Every weight comes from the file: the model is built on the meta device, then given the
    file's tensors; nothing is drawn at random first, in any mode."""
    from engine.config import ModelConfig
    from engine.model_setup import load_model

    filled = []
    normal = torch.Tensor.normal_

    def recording(tensor, *args, **kwargs):
        if tensor.device.type != "meta":
            filled.append(tuple(tensor.shape))
        return normal(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", recording)
    load_model(ModelConfig(quantization="none"))
    load_model(ModelConfig(quantization="gguf"))
    assert filled == []


@pytest.mark.slow
def test_the_embedded_model_answers_in_json_that_validates_against_the_schema():
    """Its real 49k-token vocabulary under llguidance, sampled, n > 1, in the default mode."""
    import json

    import jsonschema

    from engine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish"]},
                      "minItems": 1, "maxItems": 3}},
        "required": ["city", "country", "population", "languages"], "additionalProperties": False}
    llm = LLM()
    params = SamplingParams(max_tokens=96, temperature=0.7, n=3, seed=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outputs = llm.chat([{"role": "user", "content": "Describe Paris as JSON."}], params, use_tqdm=False)
    for choice in outputs[0].outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
