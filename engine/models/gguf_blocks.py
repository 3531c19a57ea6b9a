"""A GGUF checkpoint's quantized blocks for the paged model's matmuls, as the file stores them
(quantization `gguf`): no dequantize-requantize round trip, so the weights are exactly the file's.

GGUF keeps one tensor per projection, where the paged model fuses q/k/v and gate/up: a fused
matmul stacks its parts' rows, each part in the type the file stores it in (a Q4_K_M file keeps
attn_v in Q6_K beside Q4_K q and k). A matmul with a part of a type no kernel runs (Q2_K, Q3_K, the
IQ2/IQ3 codebooks) is left out: the model quantizes it to `int8` from its dequantized weights.
A mixture of experts keeps each projection of all experts in one 3-D tensor (ffn_*_exps):
expert e's matmuls are its slices.
llama.cpp's converter permutes q and k rows for its RoPE layout; transformers' tensor processor
for the architecture undoes it, and applied to rows of raw blocks it moves whole rows the same way.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy
from gguf import GGMLQuantizationType, GGUFReader
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from engine.cache_dir import cache_dir
from engine.models.gguf_types import runs

# paged-model matmul in layer i -> the GGUF tensors whose rows it stacks
LAYER_MATMULS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
    "mlp.shared.gate_up": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared.down": ("ffn_down_shexp",),
}
EXPERT_MATMULS = {"gate_up": ("ffn_gate_exps", "ffn_up_exps"), "down": ("ffn_down_exps",)}  # per expert e: slice e


Parts = list[tuple[GGMLQuantizationType, np.ndarray]]  # a matmul's parts, stacked by rows


def read_blocks(path: str, hf_config) -> dict[str, Parts]:
    """{module name in the paged model: its parts (GGML type, blocks (rows, bytes per row) uint8)},
    for the matmuls whose every part a kernel runs."""
    reader = GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    tensors = {t.name: t for t in reader.tensors}

    def stacked(names: list[str], expert: int | None = None) -> Parts | None:
        parts = []
        for name in names:
            tensor = tensors[name]
            data = np.asarray(tensor.data) if expert is None else np.asarray(tensor.data[expert])
            if not runs(tensor.tensor_type, int(tensor.shape[0])):  # GGUF's shape: columns first
                return None
            rows = processor.process(data, name).weights
            if parts and parts[-1][0] == tensor.tensor_type:  # one part per run of a type: one kernel pass
                parts[-1] = (tensor.tensor_type, np.concatenate([parts[-1][1], rows]))
            else:
                parts.append((tensor.tensor_type, rows))
        return parts

    found = {}
    for i in range(hf_config.num_hidden_layers):
        for matmul, names in LAYER_MATMULS.items():
            names = [f"blk.{i}.{part}.weight" for part in names]
            if all(n in tensors for n in names):
                found[f"layers.{i}.{matmul}"] = stacked(names)
        for matmul, names in EXPERT_MATMULS.items():
            names = [f"blk.{i}.{part}.weight" for part in names]
            if all(n in tensors for n in names):
                for e in range(tensors[names[0]].data.shape[0]):
                    found[f"layers.{i}.mlp.experts.{e}.{matmul}"] = stacked(names, e)
    found["lm_head"] = stacked(["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    return {name: parts for name, parts in found.items() if parts is not None}


def describe(blocks: dict[str, Parts], num_matmuls: int) -> str:
    """What took which path: the matmuls in their own blocks (by type) and those re-quantized."""
    counts: dict[str, int] = {}
    for parts in blocks.values():
        for qtype, _ in parts:
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
    kinds = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    left = num_matmuls - len(blocks)
    return (f"{len(blocks)} matmuls in the file's own blocks ({kinds})"
            + (f", {left} of types no kernel runs re-quantized to int8" if left else ""))


def stored_blocks(path: str, hf_config) -> dict[str, Parts]:
    """read_blocks, kept in the engine's cache after the first read: parsing the file's metadata
    (its whole vocabulary) and regrouping rows take seconds that every start and step-loop restart
    would wait for; the cached arrays load in a fraction of one."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # how the rows were read and arranged
    version = importlib.metadata.version("gguf")
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{version}|{code}".encode())
    target = cache_dir("models") / f"{Path(path).stem}-blocks-{key.hexdigest()[:12]}.safetensors"
    if target.is_file():
        with safetensors.safe_open(str(target), "np") as f:  # each part's GGML type in the file's metadata
            types = f.metadata()
            blocks: dict[str, Parts] = {}
            for key in sorted(f.keys(), key=lambda k: (k.rsplit("#", 1)[0], int(k.rsplit("#", 1)[1]))):
                part = (GGMLQuantizationType[types[key]], f.get_tensor(key))
                blocks.setdefault(key.rsplit("#", 1)[0], []).append(part)
            return blocks
    blocks = read_blocks(path, hf_config)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    arrays = {f"{name}#{i}": (qtype, b) for name, parts in blocks.items() for i, (qtype, b) in enumerate(parts)}
    safetensors.numpy.save_file({key: np.ascontiguousarray(b) for key, (_, b) in arrays.items()}, str(partial),
                                metadata={key: qtype.name for key, (qtype, _) in arrays.items()})
    os.replace(partial, target)  # atomic: a reader never sees half a file
    return blocks
