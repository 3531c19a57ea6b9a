"""N-gram prompt lookup: draft tokens without a model.

The request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked
up in its own earlier tokens (prompt and output); the tokens that followed the latest earlier
occurrence are the draft. It pays where outputs repeat spans of their context: extraction,
quoting, code edits. A draft is a guess with probability one (a one-hot draft distribution), so
verification reduces to sampling the target at each draft position (engine.spec_decode.verify).
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix of `token_ids`; [] when no suffix of min_n..max_n tokens occurs earlier."""
        num_tokens = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[num_tokens - n:]
            first = suffix[0]
            # latest occurrence that ends before the suffix itself starts
            for start in range(num_tokens - n - 1, -1, -1):
                if token_ids[start] == first and token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []
