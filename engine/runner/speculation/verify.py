"""Verification of draft tokens inside the target's own forward.

For a request fed its last token and drafts d1..dk, the target's logits at those k + 1 positions
are sampled like any other row (every sampling setting, penalties, seeds), each row continuing the
history with the drafts before it (engine.batch.WithDrafts). Drafts are accepted while the
target's token equals the draft; the first token that differs, or the token after the last draft
(the bonus), ends the step's tokens. This is the rejection rule of Leviathan et al. / Chen et al. (accept d
with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q))), so the output has
exactly the target's distribution, and greedy output the target's tokens:
- a one-hot draft (n-gram lookup; a draft model's argmax for greedy and seeded requests): the row
  is sampled from p as it is; it equals d with probability p(d), and given it does not, it is
  distributed as norm(max(0, p - onehot(d)));
- a draft drawn from the draft model's distribution q (engine.drafts.SampledDraft):
  the sampler applies the rule itself (engine.sampler.Sampler._verify).
"""
from __future__ import annotations


def accepted_tokens(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """The step's new tokens: the target's token at each position while it equals the draft
    there, then the first one that does not (or the bonus token after every draft)."""
    for i, draft in enumerate(drafts):
        if target_tokens[i] != draft:
            return target_tokens[:i + 1]
    return target_tokens[:len(drafts) + 1]
