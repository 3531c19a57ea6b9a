"""Grammar engines compared on this CPU: per-token mask cost at batch 1, 16 and 64.

Each of xgrammar, llguidance and outlines-core compiles the same JSON schema against the
embedded model's tokenizer (49,152 tokens), then B matchers walk the token sequence of one valid
document in lock step: per step, every matcher writes its row of a (B, vocab) token bitmask, the
mask is applied to (B, vocab) fp32 logits (the engine's apply, the same for all), and every
matcher accepts its token. Reported: compile time (once per schema: cached by the engine), the
median time of one step's fills and accepts (ms per step, µs per row) and of the apply, and
whether a length-bounded string can hold a raw control character (which no JSON parser takes).
Single-threaded fills: the engine's two cores run the model.

    pip install -e '.[bench]'   # xgrammar and outlines-core
    python -m benchmarks.grammar_libraries [--steps 60] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.quantization import cpu_features
from engine.grammar import disallowed_tokens
from engine.model_loader import load_vocabulary

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "notes"],
            "address": {"city": "London", "zip": "W1 4AB"}, "role": "admin"}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, batch: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(batch)]

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults=COMPACT)
        self.ll.LLMatcher(self.tokenizer, grammar)  # validates; llguidance compiles lazily per matcher
        return grammar

    def matchers(self, compiled, batch: int):
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(batch)]

    def bitmask(self, batch: int):
        return self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex = outlines_core, build_regex_from_schema
        eos = tokenizer.eos_token_id
        vocab: dict[str, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id != eos:
                vocab.setdefault(token, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, vocab)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.oc.Index(self.regex(json.dumps(schema)), self.vocabulary)

    def matchers(self, compiled, batch: int):
        return [self.oc.Guide(compiled) for _ in range(batch)]

    def bitmask(self, batch: int):
        return torch.zeros(batch, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def accept(self, matchers, token: int) -> None:
        for m in matchers:
            m.advance(token)


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The engine's own apply, the same for every library: the bitmask unpacked, logits masked."""
    logits.masked_fill_(disallowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def measure(engine, tokens: list[int], batch: int, steps: int, repeats: int) -> tuple[float, float]:
    """Medians over the runs of one step's (fill + accept, apply) seconds: every row's mask
    written and token accepted, then the mask applied to the logits."""
    compiled = engine.compile(SCHEMA)
    fills, applies = [], []
    for _ in range(repeats):
        matchers = engine.matchers(compiled, batch)
        bitmask = engine.bitmask(batch)
        logits = torch.randn(batch, engine.vocab_size)
        fill = masking = 0.0
        for token in tokens[:steps]:
            t0 = time.perf_counter()
            engine.fill(matchers, bitmask)
            t1 = time.perf_counter()
            apply(logits, bitmask)
            t2 = time.perf_counter()
            engine.accept(matchers, token)
            fill, masking = fill + (t1 - t0) + (time.perf_counter() - t2), masking + (t2 - t1)
        n = min(steps, len(tokens))
        fills.append(fill / n)
        applies.append(masking / n)
    return statistics.median(fills), statistics.median(applies)


def admits_control_characters(engine, tokenizer) -> bool:
    """Whether the library lets a length-bounded JSON string hold a raw control character
    (invalid JSON: json.loads refuses it)."""
    matchers = engine.matchers(engine.compile({"type": "string", "maxLength": 6}), 1)
    bitmask = engine.bitmask(1)
    (quote,) = tokenizer.encode('"', add_special_tokens=False)
    engine.accept(matchers, quote)
    engine.fill(matchers, bitmask)
    allowed = (~disallowed_tokens(bitmask, engine.vocab_size))[0].nonzero().flatten().tolist()
    return any(any(ord(ch) < 32 for ch in tokenizer.decode([t])) for t in allowed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, vocab_size = load_vocabulary(None)
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    print(cpu_features())
    print(f"document: {len(tokens)} tokens; vocab {vocab_size}; steps measured {min(args.steps, len(tokens))}")
    print("fill + accept per step, ms (µs per row), and the apply (the same code for every library):")
    print("| library | compile (s) | batch 1 | batch 16 | batch 64 | apply at 1 / 16 / 64 | valid JSON strings |")
    print("|---|---|---|---|---|---|---|")
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        engine = cls(tokenizer, vocab_size)
        t0 = time.perf_counter()
        engine.compile(SCHEMA)
        compile_s = time.perf_counter() - t0
        cells, applies = [], []
        for batch in (1, 16, 64):
            fill, masking = measure(engine, tokens, batch, args.steps, args.repeats)
            cells.append(f"{fill * 1e3:.3f} ({fill / batch * 1e6:.1f})")
            applies.append(f"{masking * 1e3:.2f}")
        valid = "no: raw control characters under maxLength" if admits_control_characters(engine, tokenizer) else "yes"
        print(f"| {engine.name} | {compile_s:.3f} | " + " | ".join(cells) + " | " + " / ".join(applies) + f" ms | "
              f"{valid} |", flush=True)


if __name__ == "__main__":
    main()
