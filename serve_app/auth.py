"""API keys and what each may ask for: the bearer token check (constant time) and the range of
priorities a request may take (router.priority_range, narrowed per key).

Owns: authentication and the priority rule. An open server (no keys) grants every client the
router's range; a key may be narrowed, so a client cannot outrank others unless allowed to.
"""

from __future__ import annotations

import hmac

from serve_app.api.wire import APIError
from serve_app.config import ApiKey, IngressConfig, PriorityRange, RouterConfig


class Authorizer:
    def __init__(self, ingress: IngressConfig, router: RouterConfig):
        self._default = router.priority_range
        self._keys = [self._entry(k) for k in ingress.api_keys]

    def _entry(self, key: str | ApiKey) -> tuple[bytes, PriorityRange]:
        if isinstance(key, str):
            return key.encode(), self._default
        return key.key.encode(), key.priority_range or self._default

    @property
    def is_open(self) -> bool:
        return not self._keys

    def authorize(self, authorization: str | None, api_key: str | None = None) -> PriorityRange:
        """The priority range of the bearer token in the Authorization header, or of `api_key`
        (an x-api-key header, as Anthropic's clients send the key); 401 if the server has keys and
        this is none of them. Every key is compared, in constant time each."""
        if self.is_open:
            return self._default
        token = authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " \
            else (api_key or "").strip()
        granted = None
        for key, allowed in self._keys:
            if hmac.compare_digest(key, token.encode("utf-8", "surrogatepass")) and granted is None:
                granted = allowed
        if granted is None:
            raise APIError(401, "Invalid or missing API key (use 'Authorization: Bearer <key>' or 'x-api-key: <key>').",
                           code="invalid_api_key")
        return granted


def resolve_priority(requested: int | None, allowed: PriorityRange) -> int:
    """The request's priority: as asked if within `allowed`, else 400; the best class allowed
    that is not better than 0 when it asks for none."""
    lo, hi = allowed
    if requested is None:
        return min(max(0, lo), hi)
    if not lo <= requested <= hi:
        raise APIError(400, f"priority must be an int in [{lo}, {hi}] for this client, got "
                            f"{requested if abs(requested) < 10**12 else 'a larger number'}", param="priority")
    return requested
