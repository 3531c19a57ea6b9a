"""Which layers share a block table: a model's layers grouped by how far back they attend.

A full-attention layer reads every earlier token; a sliding-window layer of window W reads only
the last W (itself included), so the blocks before that are free for others once a request has
passed them. Layers that attend alike share one block table per request (a KV group, as vLLM's
hybrid KV cache manager groups them), and every group has the same number of layers, so one
pool of blocks serves them all: block b is one block of memory in each of `num_slots` cache
tensors, and layer l of the model reads and writes cache tensor `slot_of[l]` at the blocks of its
group's table. A model whose layers all attend alike is one group of all its layers (a block is
one block of every layer, as before groups); a Gemma-3-shaped model (five sliding layers to one
full) is one full group and five sliding ones of equal size, so a long request holds its full
layers' blocks and only a window's worth of each sliding group's.

Groups are as large as the fewest layers of one kind; a kind whose count is not a multiple of
that has one group with fewer layers, whose unused cache slots cost memory (vLLM pads alike).
A window as long as the longest context the engine allows is full attention.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry for a block a sliding group has dropped: never read, never freed


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None  # sliding window in tokens (a query reads the last `window` keys), None: full attention
    layers: tuple[int, ...]  # the model's layers in this group; its i-th uses cache slot i

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a query at `position` reads (later queries read no earlier one)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
        """Blocks the group holds for a request computing `num_new_tokens` after `num_tokens`."""
        end = -(-(num_tokens + num_new_tokens) // block_size)
        return end - self.first_needed_block(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int  # cache tensors: the layers of the largest group
    slot_of: tuple[int, ...]  # per model layer, its cache tensor
    group_of: tuple[int, ...]  # per model layer, its group

    @classmethod
    def for_windows(cls, windows: Sequence[int | None], max_model_len: int) -> KVLayout:
        """The layout of a model whose layer l attends within windows[l] (None: everything)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(None if window is None or window >= max_model_len else window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        groups = tuple(KVGroup(window, tuple(layers[i:i + size]))
                       for window, layers in kinds.items() for i in range(0, len(layers), size))
        slot_of, group_of = [0] * len(windows), [0] * len(windows)
        for g, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                slot_of[layer], group_of[layer] = slot, g
        return cls(groups, size, tuple(slot_of), tuple(group_of))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def is_uniform(self) -> bool:
        """One group of full attention: one block table per request, every block kept."""
        return len(self.groups) == 1 and self.groups[0].window is None

    def blocks_held(self, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
        """Blocks a request holds across groups to compute `num_new_tokens` after `num_tokens`."""
        return sum(group.blocks_held(num_tokens, block_size, num_new_tokens) for group in self.groups)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once when computed in
        chunks of at most `chunk` tokens (a sliding group: its window and a chunk)."""
        total = 0
        for group in self.groups:
            held = -(-num_tokens // block_size)
            if group.window is not None:
                held = min(held, -(-(group.window - 1 + chunk) // block_size) + 1)
            total += held
        return total

    def scratch_tables(self, num_blocks: int) -> list[list[int]]:
        """Per group, the blocks of one sequence of `num_blocks` blocks in a scratch pool of
        num_groups * num_blocks blocks (quality scoring, timing and profiling run so)."""
        return [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(self.num_groups)]


def uniform_layout(num_layers: int) -> KVLayout:
    """Every layer full attention: one group."""
    return KVLayout.for_windows([None] * num_layers, 1)
