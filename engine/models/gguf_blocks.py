"""A GGUF checkpoint's tensors, mapped from the file: the paged model's matmuls in their own blocks
(quantization `gguf`), and every other tensor dequantized one at a time as it is loaded.

The file is mapped copy-on-write and never written, so the blocks the kernels read are the page
cache's pages: no copy is made, and every process serving the file shares one. A tensor is copied
only where the paged model wants another layout: llama.cpp's converter permutes q and k rows for
its RoPE layout, and transformers' tensor processor for the architecture undoes it (applied to
rows of raw blocks it moves whole rows the same way); the kernels' own regrouping of Q8_0 and
Q4_1 rows (engine/models/gguf_types.py kernel_rows).

GGUF keeps one tensor per projection, where the paged model fuses q/k/v and gate/up: a fused
matmul is its parts by rows, each part in the type the file stores it in (a Q4_K_M file keeps
attn_v in Q6_K beside Q4_K q and k), one part per tensor so that none is copied to be stacked. A
matmul with a part of a type no kernel runs (Q2_K, Q3_K, the IQ2/IQ3 codebooks) has no parts: the
model quantizes it to `int8` from `dense`, its weights dequantized alone.
A mixture of experts keeps each projection of all experts in one 3-D tensor (ffn_*_exps):
expert e's matmuls are its slices.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from engine.models import gguf_types
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
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)  # numpy's own dtypes in the reader

Parts = list[tuple[GGMLQuantizationType, np.ndarray]]  # a matmul's parts, stacked by rows


class GGUFFile(GGUFReader):
    """gguf's reader over a plain array of the mapped file: each of the thousands of small reads its
    metadata takes (a vocabulary's strings) costs a third of what it does on numpy's memmap, whose
    every slice is a memmap object (a 49k vocabulary parses in 0.9 s, not 3.1 s)."""

    @property  # type: ignore[override]  # gguf declares a memmap: this is the same pages as an ndarray
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._data = mapped.view(np.ndarray)  # the same pages; the view keeps the mapping open


class Tensor(NamedTuple):
    """A tensor of the file: gguf's ReaderTensor's fields the loader reads."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: columns first
    data: np.ndarray  # a view of the mapped file: (rows, bytes a row) uint8 for a block type


def tensor_table(path: str) -> dict:
    """The file's architecture and where each tensor lies (name, type, GGUF shape, numpy dtype and
    shape, byte offset): what mapping it takes, without the metadata (a vocabulary) before it."""
    reader = GGUFFile(path)
    return {"architecture": reader.fields["general.architecture"].contents(),
            "tensors": [[t.name, int(t.tensor_type), [int(d) for d in t.shape], t.data.dtype.str, list(t.data.shape),
                         int(t.data_offset)] for t in reader.tensors]}


class MappedGGUF:
    """The file's tensors, mapped. `matmuls`: {paged module name: [(GGUF tensor, expert or None)]};
    `table`: tensor_table's of the file (read once, kept by the loader)."""

    def __init__(self, path: str, hf_config, table: dict):
        mapped = np.memmap(path, mode="c")  # copy-on-write: the pages stay the page cache's while unwritten
        self.data = mapped.view(np.ndarray)  # the same pages; slicing a plain array costs less
        self.architecture = table["architecture"]
        self.processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=hf_config.to_dict())
        self.tensors = {}
        for name, kind, shape, dtype, np_shape, offset in table["tensors"]:
            count = int(np.prod(np_shape))
            data = self.data[offset:offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(np_shape)
            self.tensors[name] = Tensor(name, GGMLQuantizationType(kind), tuple(shape), data)
        self.matmuls: dict[str, list[tuple[str, int | None]]] = {}
        for i in range(hf_config.num_hidden_layers):
            for matmul, parts in LAYER_MATMULS.items():
                names = [f"blk.{i}.{part}.weight" for part in parts]
                if all(n in self.tensors for n in names):
                    self.matmuls[f"layers.{i}.{matmul}"] = [(n, None) for n in names]
            for matmul, parts in EXPERT_MATMULS.items():
                names = [f"blk.{i}.{part}.weight" for part in parts]
                if all(n in self.tensors for n in names):
                    for e in range(self.tensors[names[0]].data.shape[0]):
                        self.matmuls[f"layers.{i}.mlp.experts.{e}.{matmul}"] = [(n, e) for n in names]
        self.matmuls["lm_head"] = [("output.weight" if "output.weight" in self.tensors else "token_embd.weight", None)]

    def _rows(self, name: str, expert: int | None) -> np.ndarray:
        """A tensor's rows as stored (an expert's slice), in the paged model's row order."""
        data = self.tensors[name].data
        return self.processor.process(data if expert is None else data[expert], name).weights

    def parts(self, module: str) -> Parts | None:
        """A matmul's parts as the file stores them, or None where a part is of a type no kernel runs
        (or the file keeps it otherwise: a transformers-path model's, a fused tensor of its own)."""
        sources = self.matmuls.get(module)
        if sources is None or not all(  # GGUF's shape: columns first
                runs(self.tensors[n].tensor_type, int(self.tensors[n].shape[0])) for n, _ in sources):
            return None
        return [(self.tensors[n].tensor_type, self._rows(n, e)) for n, e in sources]

    def dense(self, module: str) -> torch.Tensor:
        """A matmul's weights (N, K) fp32, dequantized (a part's own copy, made now)."""
        return torch.cat([self.dequantized(n, e) for n, e in self.matmuls[module]])

    def dequantized(self, name: str, expert: int | None = None) -> torch.Tensor:
        """A tensor (an expert's slice) as fp32 rows: gguf's dequantize, bit for bit."""
        tensor = self.tensors[name]
        rows = self._rows(name, expert)
        if tensor.tensor_type in gguf_types.KERNEL_FORMATS:
            return gguf_types.dequantize(rows.reshape(-1, rows.shape[-1]), tensor.tensor_type).reshape(
                *rows.shape[:-1], -1)
        return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(rows, tensor.tensor_type), dtype=np.float32))

    def matmul_names(self) -> set[str]:
        """The GGUF tensors the matmuls read (so not loaded into the transformers skeleton)."""
        return {n for sources in self.matmuls.values() for n, _ in sources} - {"token_embd.weight"}

    def state_dict(self, hf_model, skip: set[str]) -> dict[str, torch.Tensor]:
        """{transformers parameter name: fp32 tensor} for every tensor of the file but those in
        `skip`, dequantized one at a time (transformers' loader's own name map and processor: what
        it would load, without the tensors left out)."""
        # transformers' map, of the model's own names only (its walk through every submodule again,
        # for models converted from a submodule, costs seconds)
        names = SimpleNamespace(config=hf_model.config, state_dict=hf_model.state_dict, named_children=lambda: [])
        mapping = get_gguf_hf_weights_map(names, self.processor)
        parsed: dict[str, dict] = {"tensors": {}}
        for tensor in self.tensors.values():
            if tensor.name in skip:
                continue
            data = tensor.data if tensor.tensor_type in FLOAT_TYPES else gguf_dequantize(tensor.data,
                                                                                         tensor.tensor_type)
            result = self.processor.process(weights=np.asarray(data, dtype=np.float32), name=tensor.name,
                                            tensor_key_mapping=mapping, parsed_parameters=parsed)
            if result.name in mapping:
                parsed["tensors"][mapping[result.name]] = torch.from_numpy(np.array(result.weights, np.float32))
        return parsed["tensors"]


class BlockEmbedding(torch.nn.Module):
    """An embedding table kept in its GGUF blocks: the rows looked up are dequantized (the same
    values as the whole table dequantized), so a quantized token_embd costs its file bytes, not
    4 bytes a weight."""

    blocks: torch.Tensor

    def __init__(self, qtype: GGMLQuantizationType, blocks: np.ndarray):
        super().__init__()
        self.qtype = qtype
        self.register_buffer("blocks", torch.from_numpy(blocks))  # (vocab, row bytes) uint8, mapped

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[token_ids.reshape(-1).cpu()].numpy()
        return gguf_types.dequantize(rows, self.qtype).reshape(*token_ids.shape, -1).to(token_ids.device)
