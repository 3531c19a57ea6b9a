"""OpenAI's embeddings API through the official openai client, against the app on the real engine
(a tiny random Llama): each input's embedding is transformers' last hidden state of its last
token, normalised, in input order, for text and token-id inputs; base64 holds the same floats;
`dimensions` keeps the first ones, normalised; usage counts the prompts; bad inputs are 400s naming
the field. (Embeddings in the same steps as generation: tests/engine/test_embeddings.py.)"""
from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch
from conftest import served_real_engine
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return tiny_llama


@pytest.fixture(scope="module")
def client(model):
    with served_real_engine(model, 256) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none")


def _expected(model: str, texts: list[str], dimensions: int | None = None) -> list[list[float]]:
    tokenizer, hf = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            hidden = hf(ids, output_hidden_states=True).hidden_states[-1][0, -1]
            out.append(torch.nn.functional.normalize(hidden[:dimensions], dim=0).tolist())
    return out


def test_embeddings_are_the_models_normalised_last_hidden_states(client, model):
    texts = ["the cat sat on a mat", "dogs ran fast", "blue lakes under bright stars as people sang"]
    response = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == "tiny"
    got = torch.tensor([d.embedding for d in response.data])
    assert got.shape == (3, 64)
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.allclose(got, torch.tensor(_expected(model, texts)), atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    ids = client.embeddings.create(model="tiny", input=[tokenizer.encode(t) for t in texts])
    assert torch.allclose(torch.tensor([d.embedding for d in ids.data]), got, atol=1e-6)


def test_base64_and_dimensions(client, model):
    text = "the cat sat on a mat"
    floats = client.embeddings.create(model="tiny", input=text).data[0].embedding
    raw = client.embeddings.with_raw_response.create(model="tiny", input=text, encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert list(struct.unpack(f"<{len(floats)}f", base64.b64decode(encoded))) == pytest.approx(floats, abs=1e-7)
    cut = client.embeddings.create(model="tiny", input=text, dimensions=16).data[0].embedding
    assert torch.allclose(torch.tensor(cut), torch.tensor(_expected(model, [text], 16)[0]), atol=1e-4)


@pytest.mark.parametrize("kwargs,param", [
    (dict(input="x", dimensions=65), "dimensions"),
    (dict(input=[]), "input"),
    (dict(input=[[]]), "input"),
    (dict(input="x", extra_body={"pooling": "max"}), "pooling"),
])
def test_bad_inputs_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="tiny", **kwargs)
    assert raised.value.body["param"] == param, raised.value.body
