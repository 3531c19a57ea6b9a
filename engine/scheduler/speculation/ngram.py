"""N-gram prompt lookup: draft tokens without a model.

The request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked
up in its own earlier tokens (prompt and output); the tokens that followed the latest earlier
occurrence are the draft. It pays where outputs repeat spans of their context: extraction,
quoting, code edits. A draft is a guess with probability one (a one-hot draft distribution), so
verification reduces to sampling the target at each draft position (engine.runner.speculation.verify).

Each request keeps an index from every n-gram of its tokens to where it last ended, extended by
the tokens added since the last step, so a lookup costs O(new tokens), not a scan of the context.
"""
from __future__ import annotations

from engine.request import Request


class _NgramIndex:
    """n-gram -> the latest position where it ends, over the request's tokens before its last
    one (an occurrence may overlap the suffix looked up, never be it)."""
    __slots__ = ("ends", "num_indexed")

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # positions [0, num_indexed) are indexed as n-gram ends

    def extend(self, token_ids: list[int], upto: int, min_n: int, max_n: int) -> None:
        for end in range(self.num_indexed, upto):
            for n in range(min_n, min(max_n, end + 1) + 1):
                self.ends[tuple(token_ids[end - n + 1:end + 1])] = end
        self.num_indexed = max(self.num_indexed, upto)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """For each request, up to its `max_drafts` tokens that followed the latest earlier
        occurrence of its longest matching suffix; [] when no suffix of min_n..max_n tokens
        occurred earlier."""
        return [self._propose(request, k) for request, k in zip(requests, max_drafts)]

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _propose(self, request: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        token_ids = request.token_ids
        last = len(token_ids) - 1
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _NgramIndex()
        index.extend(token_ids, last, self.min_n, self.max_n)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = index.ends.get(tuple(token_ids[last - n + 1:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + k]
        return []
