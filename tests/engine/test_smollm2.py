"""The embedded default model: greedy parity with transformers on chat prompts."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_loader import load_hf

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
        assert prompt == llm.engine.encode_chat(chat) and len(prompt) > 16
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        eos = tokenizer.eos_token_id
        ref = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
