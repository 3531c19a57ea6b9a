"""LoRA adapters: PEFT's files in the decoder's matmul layout, the adapters a replica holds, and
one step's rows grouped by adapter.

An adapter adds s * B (A x) to a projection's output (s = alpha / r, or alpha / sqrt(r) with
rsLoRA). The decoder fuses q/k/v and gate/up into one matmul each (engine/models/decoder.py), so an
adapter's matmul is its parts' A stacked (R, K) and, per part, the rows it writes: a segment (j0,
r, n0, n) says columns j0 .. j0 + r of A x times B^T (r, n, scaled) add to output columns n0 ..
n0 + n. A step's rows are grouped by adapter (`LoraBatch`), so each adapter's A and B are read
once per matmul for all its rows, as Punica's SGMV kernels group them; the base matmul runs over
every row as without adapters, in whatever mode it is quantized, and the adapters stay fp32.
Where the C++ kernels load, the model holds every installed adapter in their slots
(engine/csrc/lora.cpp), which both the decode stack and the layers' path run (one call per matmul
for all rows); on CUDA the Triton kernels do over slots stacked on the device (StackedLoraSlots);
torch's ops run the same products elsewhere.

`Adapters` is the replica's set: known names (lora_modules, loaded at run time, or found under
adapter_dirs), at most max_cpu_loras loaded (the least recently used one no request runs evicted
for a new one), files read on a thread so the step loop never waits on a disk or a bucket.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

import torch

from engine.cache_dir import cache_dir
from engine.config import LoraConfig
from engine.errors import AdapterNotFoundError, InvalidRequestError

if TYPE_CHECKING:
    from engine.models.decoder import PagedDecoder


class LoraKernel(Protocol):
    """Where adapters' products run in one call for every row: the C++ kernels' slots or the Triton ones."""

    def add(self, layer: int, which: int, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor) -> None: ...

logger = logging.getLogger(__name__)

QKV, OUT, GATE_UP, DOWN = 0, 1, 2, 3  # a layer's matmuls, in the decode stack's order
# PEFT target module -> (matmul, part of the fused matmul; None: all of it)
TARGETS = {"q_proj": (QKV, 0), "k_proj": (QKV, 1), "v_proj": (QKV, 2), "qkv_proj": (QKV, None), "o_proj": (OUT, None),
           "gate_proj": (GATE_UP, 0), "up_proj": (GATE_UP, 1), "gate_up_proj": (GATE_UP, None),
           "down_proj": (DOWN, None)}
_WEIGHT = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraMatmul:
    """One matmul's adapter: a (R, K) fp32, the parts' A stacked; per segment (j0, r, n0, n) its
    B^T times the scale, (r, n) fp32."""
    a: torch.Tensor
    segments: tuple[tuple[int, int, int, int], ...]
    b: tuple[torch.Tensor, ...]

    def add(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None) -> None:
        """out[rows] += s B (A x[rows]) (rows None: every row), in place."""
        u = (x if rows is None else x[rows]) @ self.a.t().to(x.dtype)
        for (j0, r, n0, n), bt in zip(self.segments, self.b):
            delta = u[:, j0:j0 + r] @ bt.to(x.dtype)
            if rows is None:
                out[:, n0:n0 + n] += delta
            else:
                out[rows, n0:n0 + n] += delta


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    rank: int
    matmuls: list[list[LoraMatmul | None]]  # [layer][QKV, OUT, GATE_UP, DOWN]
    nbytes: int
    load_seconds: float
    slot: int = -1  # its index in the model's adapter table, while installed
    last_used: float = 0.0
    users: int = 0  # the scheduler's requests with it: it is not evicted while any


def _output_rows(layer, which: int, part: int | None) -> tuple[int, int]:
    """(n0, n): the output rows of part `part` of a layer's fused matmul (q, k, v; or gate, up), or
    of the whole matmul (part None)."""
    width = layer.matmul_shapes[which][0]
    if part is None:
        return 0, width
    if which == QKV:
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][part]
    return part * width // 2, width // 2


def read_adapter(path: Path, model, config: LoraConfig, dtype: torch.dtype = torch.float32
                 ) -> tuple[int, list[list[LoraMatmul | None]], int]:
    """PEFT's adapter at `path` in `model`'s (engine.models.decoder.PagedDecoder) layout, its
    matrices in `dtype`: (rank, matmuls per layer, bytes). Raises InvalidRequestError saying what
    does not fit."""
    from safetensors.torch import load_file

    from engine.models.mlp import GatedMLP

    def refuse(message: str) -> NoReturn:
        raise InvalidRequestError("lora", f"adapter {path.name!r}: {message}")

    try:
        settings = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as error:
        refuse(f"no readable adapter_config.json ({error})")
    if settings.get("peft_type", "LORA") != "LORA" or settings.get("use_dora"):
        refuse("only plain LoRA adapters are served (no DoRA or other PEFT types)")
    if settings.get("modules_to_save") or settings.get("bias", "none") != "none":
        refuse("adapters with modules_to_save or trained biases are not served")
    if settings.get("rank_pattern") or settings.get("alpha_pattern"):
        refuse("per-module rank_pattern / alpha_pattern are not served")
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        refuse("no adapter_model.safetensors")
    rank, alpha = int(settings["r"]), float(settings.get("lora_alpha", settings["r"]))
    if not 1 <= rank <= config.max_lora_rank:
        refuse(f"rank {rank} is over max_lora_rank {config.max_lora_rank}")
    scale = alpha / rank ** 0.5 if settings.get("use_rslora") else alpha / rank
    found: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # layer -> target -> A and B
    for key, tensor in load_file(str(weights_file)).items():
        match = _WEIGHT.search(key)
        if match is None or match[2] not in TARGETS:
            refuse(f"weight {key!r} is not on a decoder layer's attention or MLP projection")
        found.setdefault(int(match[1]), {}).setdefault(match[2], {})[match[3]] = tensor.float()
    for at, targets in found.items():
        for target, pair in targets.items():
            if at >= len(model.layers) or set(pair) != {"A", "B"}:
                refuse(f"layer {at} {target}: needs lora_A and lora_B within the model's {len(model.layers)} layers")
    fan_in_fan_out = bool(settings.get("fan_in_fan_out"))
    matmuls: list[list[LoraMatmul | None]] = [[None] * 4 for _ in model.layers]
    nbytes = 0
    for index, layer in enumerate(model.layers):
        parts: dict[int, list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]] = {}
        for target, pair in found.get(index, {}).items():
            which, part = TARGETS[target]
            if which in (GATE_UP, DOWN) and not isinstance(layer.mlp, GatedMLP):
                refuse(f"{target} targets a mixture of experts' MLP; adapters on experts are not served")
            a, b = pair["A"], pair["B"]
            if fan_in_fan_out:
                a, b = a.t(), b.t()
            n0, n = _output_rows(layer, which, part)
            in_features = layer.matmul_shapes[which][1]
            if a.shape != (rank, in_features) or b.shape != (n, rank):
                refuse(f"layer {index} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                       f"rank {rank} and the model's ({n}, {in_features}) projection")
            parts.setdefault(which, []).append(((n0, n), a, b * scale))
        for which, entries in parts.items():
            entries.sort(key=lambda e: e[0][0])
            a = torch.cat([e[1] for e in entries]).to(dtype).contiguous()
            # B as one (N, R), so q's and k's rows are permuted as the base's are (partial rotary)
            dense = torch.zeros(layer.matmul_shapes[which][0], a.shape[0])
            segments, j0 = [], 0
            for (n0, n), _, b in entries:
                dense[n0:n0 + n, j0:j0 + rank] = b
                segments.append((j0, rank, n0, n))
                j0 += rank
            if which == QKV and layer.permutation is not None:
                dense = layer.permuted(dense, layer.permutation)
            b_parts = tuple(dense[n0:n0 + n, j:j + r].t().to(dtype).contiguous() for j, r, n0, n in segments)
            matmuls[index][which] = LoraMatmul(a, tuple(segments), b_parts)
            nbytes += a.numel() * a.element_size() + sum(b.numel() * b.element_size() for b in b_parts)
    if not nbytes:
        refuse("no LoRA weights on the model's layers")
    return rank, matmuls, nbytes


@dataclass
class LoraBatch:
    """A step's rows' adapters: `slots` (T,) int64, each row's adapter slot or -1, which the
    kernels group themselves; `kernel`: the model's slots where its kernels run (set by the model),
    else `groups` (adapter, its rows; None: every row) for torch's ops."""
    row_adapters: list[Adapter | None]
    slots: torch.Tensor
    kernel: LoraKernel | None = None

    @classmethod
    def of(cls, row_adapters: list[Adapter | None]) -> LoraBatch | None:
        """None where no row has an adapter: the step runs as without adapters."""
        if not any(row_adapters):
            return None
        return cls(row_adapters, torch.tensor([-1 if a is None else a.slot for a in row_adapters], dtype=torch.long))

    @functools.cached_property
    def groups(self) -> list[tuple[Adapter, torch.Tensor | None]]:
        by_adapter: dict[int, tuple[Adapter, list[int]]] = {}
        for row, adapter in enumerate(self.row_adapters):
            if adapter is not None:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].append(row)
        return [(adapter, None if len(rows) == len(self.row_adapters) else torch.tensor(rows, dtype=torch.long))
                for adapter, rows in by_adapter.values()]

    def add(self, layer: int, which: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter's delta for matmul `which` of `layer`, x its input after the prologue."""
        if self.kernel is not None and out.is_contiguous():
            self.kernel.add(layer, which, x.contiguous(), out, self.slots)
            return
        for adapter, rows in self.groups:
            matmul = adapter.matmuls[layer][which]
            if matmul is not None:
                matmul.add(x, out, rows)


@dataclass
class AdapterCounters:
    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0


class StackedLoraSlots:
    """The LoRA slots of a model on CUDA, for the Triton kernels (engine.models.cuda_ops.lora_add):
    per layer and matmul every slot's A (S, R, K) and scaled B^T (S, R, N) stacked in the model's
    dtype, R the widest adapter installed there (grown when a wider one comes), zero past an
    adapter's rank and outside the outputs its parts write. The same methods as the C++ kernels'
    LoraSlots (engine/csrc/lora.cpp)."""

    def __init__(self, num_slots: int, device: torch.device, dtype: torch.dtype):
        self.num_slots, self.device, self.dtype = num_slots, device, dtype
        self.stacks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def set(self, slot: int, layer: int, which: int, a: torch.Tensor, b: list[torch.Tensor], segments: torch.Tensor,
            n: int) -> None:
        rank, k = a.shape
        stacked = self.stacks.get((layer, which))
        if stacked is None or stacked[0].shape[1] < rank:  # the first adapter here, or a wider one
            wider = (torch.zeros(self.num_slots, rank, k, dtype=self.dtype, device=self.device),
                     torch.zeros(self.num_slots, rank, n, dtype=self.dtype, device=self.device))
            if stacked is not None:
                wider[0][:, :stacked[0].shape[1]] = stacked[0]
                wider[1][:, :stacked[1].shape[1]] = stacked[1]
            stacked = self.stacks[(layer, which)] = wider
        a_stack, bt_stack = stacked
        a_stack[slot].zero_()
        bt_stack[slot].zero_()
        a_stack[slot, :rank] = a.to(self.device, self.dtype)
        for (j0, r, n0, width), bt in zip(segments.tolist(), b):
            bt_stack[slot, j0:j0 + r, n0:n0 + width] = bt.to(self.device, self.dtype)

    def clear(self, slot: int) -> None:
        for a_stack, bt_stack in self.stacks.values():
            a_stack[slot].zero_()
            bt_stack[slot].zero_()

    def add(self, layer: int, which: int, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor) -> None:
        stacks = self.stacks.get((layer, which))
        if stacks is not None:
            from engine.models.cuda_ops import lora_add

            lora_add(x.contiguous(), out, slots, *stacks)


def _local_copy(url: str, name: str) -> Path:
    """`url`/`name` (an fsspec URL) copied once into the cache, where the loader reads it."""
    import fsspec

    target = cache_dir("lora") / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{url}/{name}")
    if not (target / "adapter_config.json").is_file():
        fs, root = fsspec.core.url_to_fs(url.rstrip("/") + "/" + name)
        if not fs.isdir(root):
            raise AdapterNotFoundError("model", f"adapter {name!r} not found under {url}", "model_not_found")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        fs.get(root.rstrip("/") + "/", str(partial), recursive=True)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


@dataclass
class Adapters:
    """The adapters a model serves: names to paths, the loaded ones (LRU), loads in flight.
    Every method runs on the step loop's thread; loads read files on `_reader`'s."""
    model: PagedDecoder  # installs an adapter's weights into a slot
    config: LoraConfig
    dtype: torch.dtype = torch.float32  # the adapters' matrices
    known: dict[str, str] = field(default_factory=dict)
    loaded: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)  # least recently used first
    loading: dict[str, Future] = field(default_factory=dict)
    counters: AdapterCounters = field(default_factory=AdapterCounters)

    def __post_init__(self):
        self.known.update(self.config.modules)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-reader")
        self._free_slots = list(range(self.config.max_cpu_loras - 1, -1, -1))

    def register(self, name: str, path: str) -> None:
        """`name` serves the adapter at `path` from now on (checked by the sender: LoraConfig.with_adapter)."""
        self.known[name] = path

    def unregister(self, name: str) -> None:
        """`name` is no longer served; its adapter leaves its slot once no request runs it."""
        self.known.pop(name, None)
        adapter = self.loaded.get(name)
        if adapter is not None and adapter.users == 0:
            self._evict(adapter)

    def _path(self, name: str) -> Path:
        path = self.known.get(name)
        if path is not None:
            return _local_copy(*path.rsplit("/", 1)) if "://" in path else Path(path)
        for root in self.config.adapter_dirs or ():
            if "://" in root:
                try:
                    return _local_copy(root, name)
                except AdapterNotFoundError:
                    continue
            if (Path(root) / name / "adapter_config.json").is_file():
                return Path(root) / name
        raise AdapterNotFoundError("model", f"adapter {name!r} does not exist", "model_not_found")

    def acquire(self, name: str) -> Future:
        """The adapter for a request, as a Future: done when its files are found and read on the
        reader's thread (AdapterNotFoundError or why it does not fit, if not), then `install`ed."""
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            done: Future = Future()
            done.set_result(adapter)
            return done
        future = self.loading.get(name)
        if future is None:
            future = self.loading[name] = self._reader.submit(self._read, name)
        return future

    def _read(self, name: str) -> Adapter:
        t0 = time.perf_counter()
        path = self._path(name)
        rank, matmuls, nbytes = read_adapter(path, self.model, self.config, self.dtype)
        return Adapter(name, str(path), rank, matmuls, nbytes, time.perf_counter() - t0)

    def install(self, name: str, future: Future) -> Adapter | None:
        """The read adapter of `future` installed in a slot (evicting the least recently used
        adapter no request holds); None while every slot is held (ask again). The scheduler counts
        its users from here on."""
        adapter = self.loaded.get(name)
        if adapter is None:
            adapter = future.result()
            if not self._free_slots:
                idle = next((a for a in self.loaded.values() if a.users == 0), None)
                if idle is None:
                    return None
                self._evict(idle)
            self.loading.pop(name, None)
            adapter.slot = self._free_slots.pop()
            self.model.install_lora(adapter, self.config.max_cpu_loras)
            self.loaded[name] = adapter
            self.counters.loads += 1
            self.counters.load_seconds += adapter.load_seconds
            logger.info("LoRA adapter %s (rank %d, %.1f MB) loaded in %.3f s into slot %d", name, adapter.rank,
                        adapter.nbytes / 1e6, adapter.load_seconds, adapter.slot)
        self.loaded.move_to_end(name)
        return adapter

    def forget_load(self, name: str) -> None:
        """A load that failed: the next request for `name` tries again."""
        self.loading.pop(name, None)

    def release(self, adapter: Adapter) -> None:
        adapter.users -= 1
        adapter.last_used = time.monotonic()
        if adapter.users == 0 and adapter.name not in self.known and adapter.name in self.loaded:
            self._evict(adapter)  # unloaded while it ran

    def _evict(self, adapter: Adapter) -> None:
        del self.loaded[adapter.name]
        self.model.uninstall_lora(adapter)
        self._free_slots.append(adapter.slot)
        adapter.slot = -1
        self.counters.evictions += 1
        logger.info("LoRA adapter %s evicted", adapter.name)
