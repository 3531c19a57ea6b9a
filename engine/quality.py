"""Teacher-forced quality of a loaded model against the fp32 reference: the figures a quantized
mode is held to. On a fixed English text (engine/data/english.txt: prose paragraphs of CPython
3.11 standard-library docstrings, PSF licence, shipped so every machine scores the same tokens)
each model scores every position given the true prefix, in windows scored from scratch:
top-1 agreement (the model's argmax equals the reference's) and perplexity of the true next
tokens. A quantized mode passes at top-1 agreement >= 97% and perplexity within 3%."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import scratch_cache
from engine.attention.selector import select_backend
from engine.batch import ModelInputs
from engine.models.paged_model import PagedModel

TEXT_PATH = Path(__file__).parent / "data" / "english.txt"
MIN_TOP1_AGREEMENT = 0.97
MAX_PERPLEXITY_INCREASE = 0.03
WINDOW = 256  # tokens scored from scratch together
KV_CHUNK = 16  # tokens a chunk when scoring through a cache of another dtype: each reads the earlier ones back


def eval_tokens(tokenizer, num_tokens: int = 6000) -> list[int]:
    ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


class WindowRunner:
    """Runs a CPU paged model on one sequence of up to `window` tokens from scratch: the logits of
    every position. With `chunk`, the window goes in chunks of that many tokens, each after the
    first attending to the earlier ones as read back from a cache of `kv_cache_dtype` (as chunked
    prefills and decodes read it): what rounding the cache costs shows in the scores."""

    def __init__(self, model: PagedModel, window: int = WINDOW, block_size: int = 16,
                 kv_cache_dtype: torch.dtype = torch.float32, chunk: int | None = None):
        self.model, self.block_size, self.chunk = model, block_size, chunk or window
        self.backend = select_backend("torch", torch.device("cpu"), torch.float32, model.attention)
        self.num_blocks = -(-window // block_size)
        self.kv_cache = scratch_cache(self.backend, model, self.num_blocks, block_size, kv_cache_dtype,
                                      torch.device("cpu"))

    @torch.inference_mode()
    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        logits = []
        for start in range(0, len(token_ids), self.chunk):
            end = min(start + self.chunk, len(token_ids))
            inputs = ModelInputs.one_sequence(torch.tensor(token_ids[start:end]), start, self.num_blocks,
                                              self.block_size, torch.arange(end - start), self.model.kv_layout)
            logits.append(self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                                     self.backend.build_metadata(inputs), inputs.sample_indices))
        return torch.cat(logits)


@dataclass(frozen=True)
class TokenScores:
    """What quality compares of a model's logits over a text, per position: a few numbers, not
    the logits (6,000 positions of a 49k vocabulary are 1.2 GB)."""
    argmax: torch.Tensor  # (T,) the model's best token
    margin: torch.Tensor  # (T,) its logit's lead over the second best
    nll: torch.Tensor  # (T,) -log p(the true next token); 0 at a window's last position, which is not scored


def token_scores(model: PagedModel, token_ids: list[int], window: int = WINDOW,
                 kv_cache_dtype: torch.dtype = torch.float32, chunk: int | None = None) -> TokenScores:
    """A paged model's scores, each position given the tokens before it in its window (in chunks
    through a cache of `kv_cache_dtype`: WindowRunner)."""
    run = WindowRunner(model, window, kv_cache_dtype=kv_cache_dtype, chunk=chunk)
    parts = []
    for start in range(0, len(token_ids), window):
        ids = token_ids[start:start + window]
        logits = run(ids)
        top2 = logits.topk(2, dim=-1).values
        nll = torch.zeros(len(ids))
        nll[:-1] = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
        parts.append((logits.argmax(-1), top2[:, 0] - top2[:, 1], nll))
    return TokenScores(*(torch.cat(column) for column in zip(*parts)))


@dataclass(frozen=True)
class Quality:
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1

    @property
    def passes(self) -> bool:
        return self.top1_agreement >= MIN_TOP1_AGREEMENT and abs(self.perplexity_increase) <= MAX_PERPLEXITY_INCREASE

    BAR = f"top-1 agreement >= {MIN_TOP1_AGREEMENT:.0%}, perplexity within {MAX_PERPLEXITY_INCREASE:.0%}"

    def __str__(self) -> str:
        return (f"top-1 agreement with fp32 {self.top1_agreement:.1%}, perplexity {self.perplexity:.2f} "
                f"({self.perplexity_increase:+.1%})")


def compare(reference: TokenScores, scores: TokenScores, window: int = WINDOW, min_margin: float = 0.0) -> Quality:
    """Scores the positions that predict a token inside their window (a window's last position
    predicts the next window's first token from a context that restarts there, so it is left
    out). `min_margin`: top-1 agreement counts only positions where the reference's best logit
    leads the second by at least this much (random test models are nearly flat: their argmax is
    a coin flip between near-ties that any rounding may turn)."""
    num_tokens = len(reference.nll)
    keep = torch.tensor([(i + 1) % window != 0 for i in range(num_tokens - 1)] + [False])
    decided = keep & (reference.margin >= min_margin)
    agree = (reference.argmax == scores.argmax)[decided].float().mean().item()

    def ppl(s: TokenScores) -> float:
        return math.exp(s.nll[keep].double().mean().item())

    return Quality(agree, ppl(scores), ppl(reference))
