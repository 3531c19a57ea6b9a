"""The OpenAI fields beyond the basics, through the official openai client against the app on the
real engine (tiny random Llama with a word tokenizer, its step loop in a child process):
logit_bias forces and forbids tokens, min_tokens holds back the end, echo returns the prompt (and
with logprobs its tokens' logprobs),
best_of returns its most likely samples, use_beam_search returns transformers' beams, a field
the server does not implement is a 400 naming it, the vLLM endpoints answer, and vLLM's request
extensions (prompt_logprobs, return_token_ids, return_tokens_as_token_ids, include_stop_str_in_output,
skip_special_tokens, chat's echo, add_generation_prompt and continue_final_message) work as vLLM
documents them."""

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


def test_vllms_prompt_logprobs_and_token_ids_come_back_as_vllm_returns_them(server, tiny_llama_words, client):
    prompt_ids = _ids(server, "the cat sat on a mat")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_words, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0], dim=-1)
    out = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = out.choices[0].model_extra
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for i, (token, entries) in enumerate(zip(prompt_ids[1:], scored[1:]), start=1):
        assert entries[str(token)]["logprob"] == pytest.approx(ref[i - 1, token].item(), abs=1e-4)
        ranked = sorted(entries.values(), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in ranked[:2]] == [1, 2] and len(entries) in (2, 3)
        assert entries[str(token)]["decoded_token"].strip() == "the cat sat on a mat".split()[i]
    assert choice["prompt_token_ids"] == prompt_ids
    assert httpx.post(server + "/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == \
        out.choices[0].text
    plain = client.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"} <= set(plain.choices[0].model_extra)

    question = [{"role": "user", "content": "the cat sat"}]
    chat = client.chat.completions.create(model="tiny", messages=question, max_tokens=4, temperature=0,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat.model_extra["prompt_token_ids"]) == \
        chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=question, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for chunk in chunks for c in chunk.choices for t in c.model_extra.get("token_ids") or []] == \
        chat.choices[0].model_extra["token_ids"]


def test_vllms_output_extensions_shape_the_text_and_the_tokens(server, tiny_llama_words, client):
    free = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0)
    word = free.choices[0].text.split()[1]
    kept = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0, stop=[word],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free.choices[0].text[:free.choices[0].text.index(word) + len(word)]
    assert kept.choices[0].model_extra["stop_reason"] == word
    as_ids = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=3, temperature=0, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in as_ids.choices[0].model_extra["token_ids"]]
    eos = AutoTokenizer.from_pretrained(tiny_llama_words).eos_token
    eos_id = _ids(server, eos)[0]
    forced = {"logit_bias": {str(eos_id): 100}, "ignore_eos": True}
    hidden = client.completions.create(model="tiny", prompt="the cat", max_tokens=2, temperature=0, extra_body=forced)
    shown = client.completions.create(model="tiny", prompt="the cat", max_tokens=2, temperature=0,
                                      extra_body=forced | {"skip_special_tokens": False})
    assert eos not in hidden.choices[0].text and shown.choices[0].text.count(eos) == 2


def test_chat_continues_the_final_message_and_echoes_it(server, client):
    opened = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = httpx.post(server + "/tokenize", json={"messages": opened, **flags}).json()
    continued = client.chat.completions.create(model="tiny", messages=opened, max_tokens=3, temperature=0,
                                               extra_body=flags | {"echo": True})
    assert continued.usage.prompt_tokens == prompt["count"]
    text = httpx.post(server + "/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    assert text.rstrip().endswith("sat on")  # left open: no end of turn after it
    assert continued.choices[0].message.content.startswith("sat on")
    streamed = client.chat.completions.create(model="tiny", messages=opened, max_tokens=3, temperature=0,
                                              stream=True, extra_body=flags | {"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        continued.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message and add_generation_prompt"):
        client.chat.completions.create(model="tiny", messages=opened, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_vllms_prompt_truncation_and_special_tokens_shape_the_prompt(server, client):
    text = "the cat sat on a mat"
    whole = client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body={"return_token_ids": True})
    ids = whole.choices[0].model_extra["prompt_token_ids"]
    for side, kept in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        cut = client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body={
            "return_token_ids": True, "truncate_prompt_tokens": 3} | ({"truncation_side": side} if side else {}))
        assert cut.choices[0].model_extra["prompt_token_ids"] == kept and cut.usage.prompt_tokens == 3
    to_context = client.completions.create(model="tiny", prompt=text, max_tokens=1,
                                           extra_body={"truncate_prompt_tokens": -1})
    assert to_context.usage.prompt_tokens == len(ids)
    bare = client.completions.create(model="tiny", prompt=text, max_tokens=1,
                                     extra_body={"add_special_tokens": False, "return_token_ids": True})
    assert bare.choices[0].model_extra["prompt_token_ids"] == _ids(server, text)
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": -2})


def test_llama_cpps_name_of_max_tokens_is_taken(client):
    forced = client.completions.create(model="tiny", prompt="the cat", temperature=0,
                                       extra_body={"n_predict": 3, "ignore_eos": True})
    assert forced.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="n_predict"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"n_predict": 2})
