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


def is_native(hf_model, model_impl: str) -> bool:
    """Whether the model runs as its native family (ModelConfig.model_impl)."""
    return model_impl != "transformers" and type(hf_model).__name__ in FAMILIES


def check_servable(hf_model, model_impl: str = "auto") -> None:
    """Raises UnsupportedModelError, naming the reason, for a model the chosen path cannot serve."""
    name = type(hf_model).__name__
    reason: str | None
    if model_impl == "native" and name not in FAMILIES:
        reason = "it has no native family (model_impl 'native')"
    else:
        reason = None if is_native(hf_model, model_impl) else fallback_refusal(hf_model)
    if reason is not None:
        raise UnsupportedModelError(f"architecture {name} cannot be served: {reason}; natively served: "
                                    f"{sorted(FAMILIES)}")


def build_model(hf_model, max_model_len: int, model_impl: str = "auto"):
    name = type(hf_model).__name__
    check_servable(hf_model, model_impl)
    if is_native(hf_model, model_impl):
        return PagedDecoder(hf_model, FAMILIES[name], max_model_len)
    why = "model_impl 'transformers'" if name in FAMILIES else "it has no native family"
    logger.warning("architecture %s runs through transformers' own modeling code with the engine's paged attention "
                   "(%s): continuous batching, paged KV, prefix caching and preemption as native; slower than a "
                   "native family, and without the fused decode kernels", name, why)
    return TransformersDecoder(hf_model, max_model_len)
