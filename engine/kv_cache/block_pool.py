"""Physical KV blocks: reference counts, the free queue, and the prefix-cache hash map.

Knows blocks, not requests. A block with ref_cnt 0 sits in the free queue; if it still holds a
cached hash its KV stays reusable until it is handed out again (lazy LRU eviction).
"""
from __future__ import annotations

from collections import Counter, OrderedDict


class BlockPool:
    # Invariants (check_integrity):
    #   every block is either in the free queue (ref_cnt == 0) or owned (ref_cnt > 0), never both;
    #   cached_blocks maps a hash to exactly one block whose block_hash is that hash.
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, num: int) -> list[int]:
        """Takes `num` blocks from the head of the free queue, evicting their cached hashes."""
        if num > len(self.free_queue):
            raise RuntimeError(f"asked for {num} blocks, {len(self.free_queue)} free")
        block_ids = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            if (cached := self.block_hash[block_id]) is not None:
                del self.cached_blocks[cached]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Adds an owner to each block, taking free (cached) ones out of the free queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drops one owner from each block. Unowned blocks without a hash go to the head of the
        free queue (reused first); cached ones go to the tail (evicted last), in the order given."""
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Registers a full, computed block under its hash; a hash already cached keeps its block."""
        if block_hash not in self.cached_blocks and self.block_hash[block_id] is None:
            self.cached_blocks[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def check_integrity(self, owners: Counter) -> None:
        """Raises AssertionError unless ref counts equal `owners` (block id -> number of owners)."""
        for block_id in range(self.num_blocks):
            assert self.ref_cnt[block_id] == owners.get(block_id, 0), (
                f"block {block_id}: ref_cnt {self.ref_cnt[block_id]} != owners {owners.get(block_id, 0)}")
            assert (self.ref_cnt[block_id] == 0) == (block_id in self.free_queue), f"block {block_id} free state"
        assert len(self.free_queue) + sum(1 for r in self.ref_cnt if r > 0) == self.num_blocks
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hash[block_id] == block_hash, f"block {block_id} hash map out of sync"


class HostBlockPool:
    """Host (swap) blocks: plain free list, no sharing, no caching."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, num: int) -> list[int]:
        if num > len(self.free_ids):
            raise RuntimeError(f"asked for {num} host blocks, {len(self.free_ids)} free")
        return [self.free_ids.pop() for _ in range(num)]

    def free(self, block_ids: list[int]) -> None:
        self.free_ids.extend(reversed(block_ids))

    def check_integrity(self, owned: list[int]) -> None:
        assert len(set(owned)) == len(owned), "host block owned twice"
        assert set(owned).isdisjoint(self.free_ids), "host block both owned and free"
        assert len(owned) + len(self.free_ids) == self.num_blocks, "host blocks lost"
