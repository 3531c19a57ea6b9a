"""A GGUF checkpoint's quantized blocks for the paged model's matmuls, as the file stores them
(quantization `gguf`): no dequantize-requantize round trip, so the weights are exactly the file's.

GGUF keeps one tensor per projection, where the paged model fuses q/k/v and gate/up: fused
matmuls concatenate their parts' rows, which keeps every block whole (blocks run along a row).
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
from engine.models.linear import KERNEL_FORMATS

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


def read_blocks(path: str, hf_config) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """{module name in the paged model: (GGML type, blocks (rows, bytes per row) uint8)}."""
    reader = GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    tensors = {t.name: t for t in reader.tensors}

    def stacked(names: list[str], expert: int | None = None) -> tuple[GGMLQuantizationType, np.ndarray]:
        qtypes = {tensors[n].tensor_type for n in names}
        if len(qtypes) != 1 or next(iter(qtypes)) not in KERNEL_FORMATS:
            kinds = ", ".join(f"{n} is {tensors[n].tensor_type.name}" for n in names)
            raise ValueError(f"quantization 'gguf' runs Q4_1 and Q8_0 blocks, one type per fused matmul; in {path}, "
                             f"{kinds}: use quantization 'int8' or 'none' for this file")
        parts = [np.asarray(tensors[n].data) if expert is None else np.asarray(tensors[n].data[expert]) for n in names]
        rows = [processor.process(part, n).weights for part, n in zip(parts, names)]
        return qtypes.pop(), np.concatenate(rows)

    blocks = {}
    for i in range(hf_config.num_hidden_layers):
        for matmul, parts in LAYER_MATMULS.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            if all(n in tensors for n in names):
                blocks[f"layers.{i}.{matmul}"] = stacked(names)
        for matmul, parts in EXPERT_MATMULS.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            if all(n in tensors for n in names):
                for e in range(tensors[names[0]].data.shape[0]):
                    blocks[f"layers.{i}.mlp.experts.{e}.{matmul}"] = stacked(names, e)
    blocks["lm_head"] = stacked(["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    return blocks


def stored_blocks(path: str, hf_config) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
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
        with safetensors.safe_open(str(target), "np") as f:  # each array's GGML type in the file's metadata
            types = f.metadata()
            return {name: (GGMLQuantizationType[types[name]], f.get_tensor(name)) for name in f.keys()}
    blocks = read_blocks(path, hf_config)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    safetensors.numpy.save_file({name: np.ascontiguousarray(b) for name, (_, b) in blocks.items()}, str(partial),
                                metadata={name: qtype.name for name, (qtype, _) in blocks.items()})
    os.replace(partial, target)  # atomic: a reader never sees half a file
    return blocks
