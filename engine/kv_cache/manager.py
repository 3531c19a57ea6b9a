"""Per-request block tables over the BlockPool: prefix-cache lookup, slot allocation with
copy-on-write, forks, swap mappings.

Knows requests and their blocks; does not decide who gets preempted: a failed allocation is
returned as None and the scheduler chooses what to do.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, HostBlockPool
from engine.kv_cache.hashing import extend_block_hashes
from engine.request import Request


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A cached prefix found for a request: its blocks and how many tokens they cover."""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_COMPUTED_BLOCKS = ComputedBlocks()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _hashes(self, request: Request) -> list[int]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(hashes, request.token_ids, self.block_size, request.num_tokens)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the tokens the request lets the cache serve."""
        if not self.enable_prefix_caching:
            return NO_COMPUTED_BLOCKS
        block_ids = []
        max_blocks = request.num_cacheable_tokens // self.block_size
        for block_hash in self._hashes(request)[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return ComputedBlocks(tuple(block_ids), len(block_ids) * self.block_size)

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_COMPUTED_BLOCKS) -> list[tuple[int, int]] | None:
        """Makes room for `num_new_tokens` tokens after the request's computed ones (plus a cached
        prefix `computed`, for a request with no blocks yet). Returns the copy-on-write block
        copies (src, dst) to run before the forward, or None, changing nothing, if blocks are short."""
        if not computed.block_ids and self._lands_in_own_blocks(request, num_new_tokens):
            return []  # a decode, most steps
        table, shared, num_new_blocks = self._plan(request, num_new_tokens, computed)
        if self._free_blocks_taken(shared, num_new_blocks, computed) > self.pool.num_free_blocks:
            return None
        if computed.block_ids:
            self.pool.touch(list(computed.block_ids))
            table = list(computed.block_ids)
            self._num_cached_blocks[request.request_id] = len(table)
        self.block_tables[request.request_id] = table
        copies = []
        for i in shared:
            (new_block,) = self.pool.get_new_blocks(1)
            copies.append((table[i], new_block))
            self.pool.free_blocks([table[i]])
            table[i] = new_block
        if num_new_blocks > 0:
            table.extend(self.pool.get_new_blocks(num_new_blocks))
        return copies

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int,
                               computed: ComputedBlocks = NO_COMPUTED_BLOCKS) -> int:
        """Free blocks `allocate_slots` would take: new blocks, copies of shared blocks it
        writes, and cached prefix blocks that now sit in the free queue."""
        _, shared, num_new_blocks = self._plan(request, num_new_tokens, computed)
        return self._free_blocks_taken(shared, num_new_blocks, computed)

    def _plan(self, request: Request, num_new_tokens: int, computed: ComputedBlocks
              ) -> tuple[list[int], list[int], int]:
        """Writing `num_new_tokens` after the request's computed tokens (and `computed`): its
        table, the indexes of the table's blocks to copy first (shared or cached ones the
        tokens land in), and the number of blocks to add (negative: that many to spare)."""
        table = self.block_tables.get(request.request_id, [])
        start = request.num_computed_tokens + computed.num_tokens
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        shared = self._shared(table, start // self.block_size, min(len(table), end_block))
        return table, shared, end_block - len(table) - len(computed.block_ids)

    def _lands_in_own_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` after the request's computed tokens land in blocks its table
        already has, none of them to copy first: nothing to allocate or copy (a `_plan` that
        would find so, made without one for a decode's slots, most steps of most requests)."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return False
        start = request.num_computed_tokens
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        return end_block <= len(table) and not self._shared(table, start // self.block_size, end_block)

    def _shared(self, table: list[int], first: int, end: int) -> list[int]:
        """Indexes in table[first:end] of the blocks a write must copy first: another request
        holds them too, or the prefix cache does."""
        ref_cnt, block_hash = self.pool.ref_cnt, self.pool.block_hash
        shared = []
        for i in range(first, end):  # a loop: a comprehension's call costs more, per decode
            if ref_cnt[table[i]] > 1 or block_hash[table[i]] is not None:
                shared.append(i)
        return shared

    def _free_blocks_taken(self, shared: list[int], num_new_blocks: int, computed: ComputedBlocks) -> int:
        """Free blocks a `_plan` takes: its new blocks, a copy of each shared block, and the
        blocks of a cached prefix that sit in the free queue."""
        touched_free = sum(1 for b in computed.block_ids if self.pool.ref_cnt[b] == 0) if computed.block_ids else 0
        return max(num_new_blocks, 0) + len(shared) + touched_free

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens in the request's leading blocks that other requests also hold: they survive its
        preemption, so recomputing them is free."""
        num_blocks = 0
        for block_id in self.block_tables.get(request.request_id, []):
            if self.pool.ref_cnt[block_id] < 2:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's blocks, shared: writes to a shared block copy it first."""
        table = list(self.block_tables[parent.request_id])
        self.pool.touch(table)
        self.block_tables[child.request_id] = table

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        table = self.block_tables[request.request_id]
        hashes = self._hashes(request)
        for i in range(done, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free_beyond(self, request: Request, num_tokens: int) -> None:
        """Releases the request's blocks after those covering its first `num_tokens` positions
        (blocks that held only rejected draft tokens)."""
        table = self.block_tables[request.request_id]
        keep = self.num_blocks_for(num_tokens)
        if len(table) > keep:
            self.pool.free_blocks(list(reversed(table[keep:])))
            del table[keep:]

    def free(self, request: Request) -> None:
        """Releases every block the request holds, on device and host. Tail blocks first, so a
        shared prefix outlives the blocks after it in the LRU order."""
        rid = request.request_id
        self.pool.free_blocks(list(reversed(self.block_tables.pop(rid, []))))
        self.host_pool.free(self.host_tables.pop(rid, []))
        self._num_cached_blocks.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drops per-request hash state once the request has ended."""
        self._block_hashes.pop(request.request_id, None)

    # ---- swap ----------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the request's blocks to the host pool: returns (device, host) pairs to copy, or
        None, changing nothing, when the host pool is too small."""
        table = self.block_tables[request.request_id]
        if len(table) > self.host_pool.num_free_blocks:
            return None
        host_ids = self.host_pool.allocate(len(table))
        self.host_tables[request.request_id] = host_ids
        self.pool.free_blocks(list(reversed(self.block_tables.pop(request.request_id))))
        self._num_cached_blocks.pop(request.request_id, None)
        return list(zip(table, host_ids))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Brings a swapped request's blocks back: returns (host, device) pairs, or None."""
        host_ids = self.host_tables[request.request_id]
        if len(host_ids) > self.pool.num_free_blocks:
            return None
        device_ids = self.pool.get_new_blocks(len(host_ids))
        self.block_tables[request.request_id] = device_ids
        self.host_pool.free(self.host_tables.pop(request.request_id))
        return list(zip(host_ids, device_ids))

    def num_swapped_blocks(self, request: Request) -> int:
        return len(self.host_tables[request.request_id])

    def check_integrity(self) -> None:
        """Asserts exact accounting: device ref counts equal owners, host blocks owned once."""
        owners = Counter(b for table in self.block_tables.values() for b in table)
        self.pool.check_integrity(owners)
        self.host_pool.check_integrity([b for table in self.host_tables.values() for b in table])
