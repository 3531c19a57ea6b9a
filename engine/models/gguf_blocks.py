"""A GGUF checkpoint's quantized blocks for the paged model's matmuls, as the file stores them
(quantization `gguf`): no dequantize-requantize round trip, so the weights are exactly the file's.

GGUF keeps one tensor per projection, where the paged model fuses q/k/v and gate/up: fused
matmuls concatenate their parts' rows, which keeps every block whole (blocks run along a row).
llama.cpp's converter permutes q and k rows for its RoPE layout; transformers' tensor processor
for the architecture undoes it, and applied to rows of raw blocks it moves whole rows the same way.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from engine.models.linear import KERNEL_FORMATS

# paged-model matmul -> the GGUF tensors whose rows it stacks; {i}: the layer
LAYER_MATMULS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def read_blocks(path: str, hf_config) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """{module name in the paged model: (GGML type, blocks (rows, bytes per row) uint8)}."""
    reader = GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    tensors = {t.name: t for t in reader.tensors}

    def stacked(names: list[str]) -> tuple[GGMLQuantizationType, np.ndarray]:
        qtypes = {tensors[n].tensor_type for n in names}
        if len(qtypes) != 1 or next(iter(qtypes)) not in KERNEL_FORMATS:
            kinds = ", ".join(f"{n} is {tensors[n].tensor_type.name}" for n in names)
            raise ValueError(f"quantization 'gguf' runs Q4_1 and Q8_0 blocks, one type per fused matmul; in {path}, "
                             f"{kinds}: use quantization 'int8' or 'none' for this file")
        rows = [processor.process(np.asarray(tensors[n].data), n).weights for n in names]
        return qtypes.pop(), np.concatenate(rows)

    blocks = {f"layers.{i}.{matmul}": stacked([f"blk.{i}.{part}.weight" for part in parts])
              for i in range(hf_config.num_hidden_layers) for matmul, parts in LAYER_MATMULS.items()}
    blocks["lm_head"] = stacked(["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    return blocks
