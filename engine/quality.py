"""Teacher-forced quality of a loaded model against the fp32 reference: the figures a quantized
mode is held to. On a fixed English text (engine/data/english.txt: prose paragraphs of CPython
3.11 standard-library docstrings, PSF licence, shipped so every machine scores the same tokens)
each model scores every position given the true prefix, in windows scored from scratch:
top-1 agreement (the model's argmax equals the reference's) and perplexity of the true next
tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import select_backend
from engine.model_loader import LoadedModel
from engine.runner.inputs import ModelInputs

TEXT_PATH = Path(__file__).parent / "data" / "english.txt"


def eval_tokens(tokenizer, num_tokens: int = 6000) -> list[int]:
    ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


@torch.inference_mode()
def position_logits(loaded: LoadedModel, token_ids: list[int], window: int = 256, block_size: int = 16) -> torch.Tensor:
    """(len(token_ids), vocab) logits, each position given the tokens before it in its window."""
    model = loaded.model
    backend = select_backend("torch", torch.device("cpu"), torch.float32, model.head_dim ** -0.5)
    num_blocks = -(-window // block_size)
    kv_cache = backend.allocate_kv_cache(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                                         model.head_dim, dtype=torch.float32, device=torch.device("cpu"))
    out = []
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start:start + window]
        n = len(chunk)
        positions = torch.arange(n)
        inputs = ModelInputs(torch.tensor(chunk), positions, positions.clone(), [0, n], [n], [0],
                             [list(range(num_blocks))], 0, block_size, positions.clone(), [], [], [])
        out.append(model(inputs.input_ids, inputs.positions, kv_cache, backend, backend.build_metadata(inputs),
                         inputs.sample_indices))
    return torch.cat(out)


@dataclass(frozen=True)
class Quality:
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1


def compare(reference: torch.Tensor, logits: torch.Tensor, token_ids: list[int], window: int = 256,
            min_margin: float = 0.0) -> Quality:
    """Scores the positions that predict a token inside their window (a window's last position
    predicts the next window's first token from a context that restarts there, so it is left
    out). `min_margin`: top-1 agreement counts only positions where the reference's best logit
    leads the second by at least this much (random test models are nearly flat: their argmax is
    a coin flip between near-ties that any rounding may turn)."""
    keep = torch.tensor([(i + 1) % window != 0 for i in range(len(token_ids) - 1)] + [False])
    top2 = reference.topk(2, dim=-1).values
    decided = keep & (top2[:, 0] - top2[:, 1] >= min_margin)
    agree = (reference.argmax(-1) == logits.argmax(-1))[decided].float().mean().item()
    ids = torch.tensor(token_ids)
    targets = ids[1:][keep[:-1]]

    def ppl(x: torch.Tensor) -> float:
        return math.exp(torch.nn.functional.cross_entropy(x[keep], targets).item())

    return Quality(agree, ppl(logits), ppl(reference))
