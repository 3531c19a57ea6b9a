"""The OpenAI fields beyond the basics, through the official openai client against the app on the
real engine (tiny random Llama with a word tokenizer, its step loop in a child process):
logit_bias forces and forbids tokens, min_tokens holds back the end, echo returns the prompt (and
with logprobs its tokens' logprobs),
best_of returns its most likely samples, use_beam_search returns transformers' beams, a field
the server does not implement is a 400 naming it, and the vLLM endpoints answer."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import served_real_engine
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def server(tiny_llama_words):
    with served_real_engine(tiny_llama_words, 128) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def _ids(server: str, text: str) -> list[int]:
    return httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_forces_and_forbids_a_token(server, client):
    free = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=6, temperature=0)
    first = _ids(server, free.choices[0].text)[0]
    (word,) = _ids(server, "cat")
    assert httpx.post(server + "/detokenize", json={"tokens": [word]}).json()["prompt"].strip() == "cat"
    forced = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=4, temperature=0,
                                       logit_bias={str(word): 100})
    assert _ids(server, forced.choices[0].text) == [word] * 4
    banned = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert first not in _ids(server, banned.choices[0].text)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            temperature=0, logit_bias={str(word): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).split() == ["cat"] * 3


def test_min_tokens_holds_back_the_end_of_the_output(server, client):
    stop = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0)
    words = stop.choices[0].text.split()
    held = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0,
                                     stop=[words[0]], extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens == 8 and held.choices[0].finish_reason == "length"
    cut = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0, stop=[words[0]])
    assert cut.usage.completion_tokens < 8 and cut.choices[0].finish_reason == "stop"


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "the cat sat" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_tokens_first(server, tiny_llama_words, client):
    prompt_ids = _ids(server, "the cat sat on a mat")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_words, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0], dim=-1)
    plain = client.completions.create(model="tiny", prompt="the cat sat on a mat", max_tokens=3, temperature=0,
                                      logprobs=2)
    echoed = client.completions.create(model="tiny", prompt="the cat sat on a mat", max_tokens=3, temperature=0,
                                       logprobs=2, echo=True)
    lp = echoed.choices[0].logprobs
    n = len(prompt_ids)
    assert [s.strip() for s in lp.tokens[:n]] == "the cat sat on a mat".split()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([ref[i - 1, t].item() for i, t in enumerate(prompt_ids) if i],
                                                   abs=1e-4)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert echoed.choices[0].text == "the cat sat on a mat" + plain.choices[0].text
    streamed = client.completions.create(model="tiny", prompt="the cat sat on a mat", max_tokens=3, temperature=0,
                                         logprobs=2, echo=True, stream=True)
    tokens = [t for chunk in streamed for c in chunk.choices for t in c.logprobs.tokens]
    assert tokens == lp.tokens


def test_a_field_the_server_does_not_implement_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: prediction"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       prediction={"type": "content", "content": "hi there"})
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=2, stream=True)


def test_use_beam_search_returns_transformers_beams(tiny_llama_words, client):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_words)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_words, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode("the cat sat")])
    rows = hf.generate(ids, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=8,
                       attention_mask=torch.ones_like(ids))[:, ids.shape[1]:]
    expected = [tokenizer.decode(row, skip_special_tokens=True) for row in rows.tolist()]
    beams = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, n=3, temperature=0,
                                      extra_body={"use_beam_search": True})
    assert [c.text for c in beams.choices] == expected and [c.index for c in beams.choices] == [0, 1, 2]
    assert beams.usage.completion_tokens == sum(len(r) for r in rows.tolist())
    streamed = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, n=3, stream=True,
                                         extra_body={"use_beam_search": True})
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == expected


def test_best_of_returns_the_n_most_likely_of_its_samples(client):
    kwargs = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 5, "temperature": 1.0, "seed": 11}
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None


def test_vllm_endpoints_answer_for_the_real_tokenizer(server, client):
    ids = _ids(server, "the cat sat")
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"].strip() == "the cat sat"
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 128
    assert httpx.get(server + "/version").json()["version"]
