"""The DraftModel Ray Serve deployment as an engine's draft transport (placement `actor`).

One call per engine step carries every speculating request's query; its reply is awaited until
the deadline. A late reply, a draft replica that is down or restarting, or no replica yet: the
step decodes without drafts, and the next step asks again, unless the late call is still running
(a call sent behind it would wait for it and be late too). Ray is imported here only, so an engine
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
_GIVE_UP_S = 10.0  # a late call still unanswered after this is taken for lost


class ServeDraftTransport:
    def __init__(self, app_name: str, deadline_s: float):
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False,
                     logging_level=logging.WARNING)
        self.handle = serve.get_deployment_handle(DRAFT_DEPLOYMENT, app_name)
        self.deadline_s = deadline_s
        self.num_missed = 0  # steps that got no drafts
        self._late = None  # (response, sent at) of the call that missed its deadline, until it is done
        self._warned_at = -_WARN_EVERY_S

    def __call__(self, call: DraftCall) -> DraftReply | None:
        if self._late is not None:  # never queue a call behind a late one: it would be late too
            response, sent_at = self._late
            try:
                response.result(timeout_s=0)
            except TimeoutError:
                if time.monotonic() - sent_at < _GIVE_UP_S:
                    return self._missed("the previous call is still running")
                response.cancel()  # lost (e.g. with its replica): ask again
            except Exception:  # it failed; this call may find a replica
                logger.debug("a late draft call failed", exc_info=True)
            self._late = None
        response, sent_at = self.handle.propose.remote(call), time.monotonic()
        try:
            return response.result(timeout_s=self.deadline_s)
        except TimeoutError:
            self._late = response, sent_at
            return self._missed(f"no reply within {self.deadline_s} s")
        except Exception as e:  # the draft replica failed or is gone
            return self._missed(repr(e))

    def _missed(self, why: str) -> None:
        """Plain decoding this step."""
        self.num_missed += 1
        if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = time.monotonic()
            logger.warning("draft proposals missed (%d steps so far): %s", self.num_missed, why)
