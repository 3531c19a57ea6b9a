"""The ingress's prompt tokenization, off its event loop and in batches.

Tokenizing a text prompt costs ~1 us a token (SmolLM2's tokenizer), and on the loop it holds up
every stream the ingress serves: a burst of long prompts, or one of 100k tokens, stalls them all.
Here the texts that arrive while a batch is being tokenized wait and go together as the next
batch (serve_app.batching) to the fast tokenizer's `encode_batch`, in a worker thread: it releases the GIL and spreads
a batch over the cores (as vLLM's micro-batching tokenizer does). The worker holds a copy of the
Rust tokenizer, since the loop's transformers calls set options on the one they share (truncation,
special tokens), a borrow that a running `encode_batch` would make fail. A tokenizer that is not
a fast one is called text by text, in the worker all the same.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.tokenization import check_text, untokenizable
from serve_app.batching import CallBatcher

MAX_BATCH = 64  # texts a batch: a burst's next ones are not held up behind a very large one


class BatchTokenizer:
    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # transformers' fast tokenizer: encode as its `encode` does
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self._tokenizer, self._backend = tokenizer, backend
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="cbserve-tokenize")
        self._batches: CallBatcher[tuple[str, bool, asyncio.Future]] = CallBatcher(self._encode_in_worker, MAX_BATCH)

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """`engine.tokenization.encode_text`'s ids, and its errors (`param`: the field at fault)."""
        check_text(text, param)
        future = asyncio.get_running_loop().create_future()
        self._batches.add((text, bool(add_special_tokens), future))
        result = await future
        if isinstance(result, Exception):
            raise untokenizable(param, result)
        return result

    async def _encode_in_worker(self, batch: list[tuple[str, bool, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._worker, self._encode_all, [(t, s) for t, s, _ in batch])
        except Exception as e:  # the worker is gone (the process shuts down): the batch's requests fail
            results = [e] * len(batch)
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, _, future), result in zip(batch, results):
            if not future.done():  # else its request went away
                future.set_result(result)

    def _encode_all(self, texts: list[tuple[str, bool]]) -> list[list[int] | Exception]:
        """In the worker: each text's ids, or the error that text alone raises."""
        results: list[list[int] | Exception] = [[] for _ in texts]
        for special in (True, False):
            rows = [i for i, (_, s) in enumerate(texts) if s is special]
            if rows:
                for i, result in zip(rows, self._encode_each([texts[i][0] for i in rows], special)):
                    results[i] = result
        return results

    def _encode_each(self, texts: list[str], add_special_tokens: bool) -> list[list[int] | Exception]:
        try:
            return self._encode_batch(texts, add_special_tokens)
        except Exception as e:  # one text the tokenizer refuses fails the batch: find it, the others go on
            if len(texts) == 1:
                return [e]
            results: list[list[int] | Exception] = []
            for text in texts:
                try:
                    results.extend(self._encode_batch([text], add_special_tokens))
                except Exception as refused:
                    results.append(refused)
            return results

    def _encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int] | Exception]:
        if self._backend is not None:
            encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
            return [encoding.ids for encoding in encodings]
        return [list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens)) for text in texts]
