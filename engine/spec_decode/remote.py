"""The DraftModel Ray Serve deployment as an engine's draft transport (placement `actor`).

One call per engine step carries every speculating request's query; its reply is awaited until
the deadline. A late reply, a draft replica that is down or restarting, or no replica yet: the
step decodes without drafts, and the next step asks again. Ray is imported here only, so an engine
with local drafts never needs it. In an engine process of its own (not a Ray worker), the
transport connects to the cluster at RAY_ADDRESS, which the serve replica sets for it.
"""
from __future__ import annotations

import logging
import os
import time

from engine.spec_decode.messages import DRAFT_DEPLOYMENT, DraftCall, DraftReply

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0


class ServeDraftTransport:
    def __init__(self, app_name: str, deadline_s: float):
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False,
                     logging_level=logging.WARNING)
        self.handle = serve.get_deployment_handle(DRAFT_DEPLOYMENT, app_name)
        self.deadline_s = deadline_s
        self.num_missed = 0  # calls that brought no drafts
        self._warned_at = -_WARN_EVERY_S

    def __call__(self, call: DraftCall) -> DraftReply | None:
        response = self.handle.propose.remote(call)
        try:
            return response.result(timeout_s=self.deadline_s)
        except Exception as e:  # late or failed: plain decoding this step
            response.cancel()
            self.num_missed += 1
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                logger.warning("draft proposals missed (%d calls so far): %r", self.num_missed, e)
            return None
