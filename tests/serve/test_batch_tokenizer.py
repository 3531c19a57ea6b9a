"""The ingress's prompts tokenized off its event loop, in batches: the ids and errors of the
tokenizer's own calls, the loop free while a batch is tokenized, one bad text failing alone."""
from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import local_stack, run
from fake_engine import FakeAsyncEngine, FakeTokenizer

from engine.errors import InvalidRequestError
from engine.model_loader import load_vocabulary
from engine.tokenization import encode_chat, encode_text, render_chat
from serve_app.batch_tokenizer import BatchTokenizer
from tests.conftest import build_tokenizer

TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "<|im_start|>user\nhi<|im_end|>\n",
         "naïve café — 東京 🚀\n\n\ttabs", "stars " * 300, "x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a <|im_end|> color."}]


class HeldTokenizer(FakeTokenizer):
    """Records the thread and text of each encode; "hold" waits until `release` is set; a text
    with "bad" in it is refused."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((threading.current_thread().name, text))
        if text == "hold":
            assert self.release.wait(10)
        if "bad" in text:
            raise ValueError("no such word")
        return super().encode(text, add_special_tokens)


async def held_worker(tokens: BatchTokenizer, tok: HeldTokenizer) -> asyncio.Future:
    """"hold" sent to the worker, and the worker inside its encode until `tok.release`."""
    held = asyncio.ensure_future(tokens.encode("hold"))
    for _ in range(1000):
        if tok.calls:
            return held
        await asyncio.sleep(0.01)
    raise AssertionError("the worker never started")


@pytest.mark.parametrize("tokenizer", ["embedded", "tiny bpe"])
def test_a_batchs_ids_are_the_tokenizers_own_with_and_without_special_tokens(tokenizer):
    tok = load_vocabulary(None)[0] if tokenizer == "embedded" else build_tokenizer("bpe")
    tokens = BatchTokenizer(tok)
    chat_text = render_chat(tok, CHAT)

    async def go():
        texts = [(text, special) for text in TEXTS for special in (True, False)] + [(chat_text, False)]
        return await asyncio.gather(*(tokens.encode(text, special) for text, special in texts))

    ids = run(go())
    expected = [encode_text(tok, text, special) for text in TEXTS for special in (True, False)]
    assert ids[:-1] == expected
    templated = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[-1] == encode_chat(tok, CHAT) == list(templated)  # as transformers tokenizes a chat
    assert len(set(map(tuple, ids))) > len(TEXTS)  # the texts differ, and so do their ids


def test_texts_are_tokenized_in_the_worker_in_arrival_order_while_the_loop_goes_on():
    tok = HeldTokenizer()
    tokens = BatchTokenizer(tok)

    async def go():
        held = await held_worker(tokens, tok)
        queued = [asyncio.ensure_future(tokens.encode(f"t{i} word", i % 2 == 0)) for i in range(10)]
        await asyncio.sleep(0.05)  # the loop runs while the worker is held
        assert [text for _, text in tok.calls] == ["hold"]
        tok.release.set()
        return await held, await asyncio.gather(*queued)

    held, queued = run(go())
    assert held == FakeTokenizer().encode("hold")
    assert queued == [FakeTokenizer().encode(f"t{i} word") for i in range(10)]
    assert [text for _, text in tok.calls] == ["hold"] + [f"t{i} word" for i in range(0, 10, 2)] + \
        [f"t{i} word" for i in range(1, 10, 2)]  # the queued ten as one batch, with special tokens first
    assert {thread for thread, _ in tok.calls} == {"cbserve-tokenize_0"}


def test_a_text_the_tokenizer_refuses_fails_alone_and_a_request_gone_away_takes_nothing_with_it():
    tok = HeldTokenizer()
    tokens = BatchTokenizer(tok)

    async def go():
        held = await held_worker(tokens, tok)
        good, bad, gone = (asyncio.ensure_future(tokens.encode(text, param=param)) for text, param in
                           (("t1 t2", "prompt"), ("a bad word", "messages"), ("t5", "prompt")))
        await asyncio.sleep(0.05)
        gone.cancel()
        tok.release.set()
        with pytest.raises(InvalidRequestError) as refused:
            await bad
        return await held, await good, refused.value

    held, good, refused = run(go())
    assert good == [1, 2]
    assert refused.param == "messages" and "messages could not be tokenized: no such word" in str(refused)
    with pytest.raises(InvalidRequestError, match="prompt must be a non-empty string"):
        run(tokens.encode(""))


def test_the_ingress_tokenizes_completions_chats_and_tokenize_requests_in_the_worker():
    tok = HeldTokenizer()
    tok.release.set()

    async def go():
        async with local_stack(engine_cls=FakeAsyncEngine.with_options(tokenizer=tok)) as (client, _, _):
            r = await client.post("/v1/completions", json={"prompt": ["t1 t2", "t3"], "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 3
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t7"}],
                                                                "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await client.post("/tokenize", json={"prompt": "t4 t5 t6"})
            assert r.json()["tokens"] == [4, 5, 6]
            r = await client.post("/v1/completions", json={"prompt": "a bad word", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

    run(go())
    assert [text for _, text in tok.calls] == ["t1 t2", "t3", "user t7 t3", "t4 t5 t6", "a bad word"]  # each once
    assert {thread for thread, _ in tok.calls} == {"cbserve-tokenize_0"}
