"""Which paged model serves a transformers model: a native family's PagedDecoder
(engine/models/families.py), else transformers' own modeling code with the engine's paged
attention plugged in (engine/models/transformers_backend.py), else a clear refusal."""
from __future__ import annotations

import logging

from engine.errors import UnsupportedModelError
from engine.models.decoder import PagedDecoder
from engine.models.families import FAMILIES
from engine.models.transformers_backend import TransformersDecoder, fallback_refusal

logger = logging.getLogger(__name__)


def build_model(hf_model, max_model_len: int):
    name = type(hf_model).__name__
    if name in FAMILIES:
        return PagedDecoder(hf_model, FAMILIES[name], max_model_len)
    reason = fallback_refusal(hf_model)
    if reason is not None:
        raise UnsupportedModelError(f"architecture {name} cannot be served: {reason}; natively served: "
                                    f"{sorted(FAMILIES)}")
    logger.warning("architecture %s has no native implementation: it runs through transformers' own modeling code "
                   "with the engine's paged attention (continuous batching, paged KV, prefix caching and preemption "
                   "as native; slower than a native family, and without the fused decode kernels)", name)
    return TransformersDecoder(hf_model, max_model_len)
