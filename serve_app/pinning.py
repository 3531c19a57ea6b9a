"""`PinnedReplicaRequestRouter`: a Serve RequestRouter for the EngineReplica deployment that sends
a call to the replica its message names (`replica_id` of its first argument: serve_app.transport's
messages), the one our Router chose.

It runs inside each caller's DeploymentHandle (the ingress), so it holds no global state: the
global queue lives in serve_app.router. Calls without a hint (model_info) go to any replica.
If the named replica is not (yet) in this handle's view, all replicas are candidates: the
request still runs, and the next load report corrects the router's picture.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PinnedReplicaRequestRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hint = None
        if pending_request is not None and pending_request.args:
            hint = getattr(pending_request.args[0], "replica_id", None)
        if hint is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == hint:
                    return [[replica]]
        shuffled = list(candidate_replicas)
        random.shuffle(shuffled)
        return [shuffled]
