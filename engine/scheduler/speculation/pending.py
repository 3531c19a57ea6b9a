"""The scheduler's proposer when drafts come from a model in the runner (`self_draft`,
`draft_model`): it reserves each request's draft slots; the runner's drafter
(engine/runner/speculation/) writes the tokens into them before the target's forward."""
from __future__ import annotations

from engine.request import Request

PENDING = -1  # a reserved draft the runner has not filled in yet (never a valid token id)


class PendingDrafts:
    """Reserves as many slots as each request's limit (adaptive or not)."""

    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        return [[PENDING] * max(k, 0) for k in max_drafts]

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
