"""Per-request block tables over the BlockPool: prefix-cache lookup, slot allocation with
copy-on-write, forks, swap mappings, and the blocks a sliding-window group no longer reads.

A request has one block table per KV group (engine/kv_cache/layout.py): entry i of a group's
table is the block holding positions [i * block_size, (i + 1) * block_size) for that group's
layers. A sliding group's entries before its window hold NULL_BLOCK: those blocks are freed as
the request passes them (before its next allocation), their cached hashes kept, so a later
request with the same prefix still finds them while they are not reused. A model with one full
group has one table per request, as before groups.

Knows requests and their blocks; does not decide who gets preempted: a failed allocation is
returned as None and the scheduler chooses what to do.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, HostBlockPool
from engine.kv_cache.hashing import adapter_cache_root, extend_block_hashes
from engine.kv_cache.layout import NULL_BLOCK, KVLayout, uniform_layout
from engine.request import Request

Tables = list[list[int]]  # one block table per KV group


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A cached prefix found for a request: per KV group its blocks (a sliding group's before its
    window NULL_BLOCK), and how many tokens they cover."""
    block_ids: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0


NO_COMPUTED_BLOCKS = ComputedBlocks()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, layout: KVLayout | None = None):
        """`layout`: the model's KV groups (default: one full-attention group)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or uniform_layout(1)
        self.pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.block_tables: dict[str, Tables] = {}
        self.host_tables: dict[str, Tables] = {}
        self._block_hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._sliding = [g for g, group in enumerate(self.layout.groups) if group.window is not None]
        self._num_dropped: dict[str, list[int]] = {}  # per request, per group: leading entries dropped

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

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """KVLayout.peak_blocks in this manager's blocks."""
        return self.layout.peak_blocks(num_tokens, self.block_size, chunk)

    def copy_tables(self, request_id: str) -> Tables:
        """The request's block tables as they are now (a step's own copy: later allocations change them)."""
        return [table.copy() for table in self.block_tables[request_id]]

    def num_held_blocks(self, request: Request) -> int:
        return sum(b != NULL_BLOCK for table in self.block_tables.get(request.request_id, ()) for b in table)

    def _hashes(self, request: Request) -> list[int]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        # an adapter's requests' blocks hold its keys and values: their hashes are rooted at its name (the
        # root is read only for the first block)
        root = adapter_cache_root(request.adapter.name) if request.adapter is not None and not hashes else None
        return extend_block_hashes(hashes, request.token_ids, self.block_size, request.num_tokens, root)

    @staticmethod
    def _key(group: int, block_hash: int) -> int:
        """A block's key in the prefix cache: its tokens' hash, told apart per group (each group's
        layers keep their own copy of the same positions)."""
        return block_hash if group == 0 else hash((group, block_hash))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the tokens the request lets the cache serve: as far as every
        full group has all blocks cached and every sliding group the blocks its window reads."""
        if not self.enable_prefix_caching:
            return NO_COMPUTED_BLOCKS
        hashes = self._hashes(request)[:request.num_cacheable_tokens // self.block_size]
        cached = [[self.pool.get_cached_block(self._key(g, h)) for h in hashes]
                  for g in range(self.layout.num_groups)]
        num_hit = len(hashes)
        for g, group in enumerate(self.layout.groups):
            if group.window is None:
                num_hit = next((i for i, b in enumerate(cached[g][:num_hit]) if b is None), num_hit)
        while num_hit > 0 and not all(None not in cached[g][self._first_needed(g, num_hit):num_hit]
                                      for g in self._sliding):
            num_hit -= 1
        if num_hit == 0:
            return NO_COMPUTED_BLOCKS
        block_ids = tuple((NULL_BLOCK,) * (lo := self._first_needed(g, num_hit))
                          + tuple(b for b in cached[g][lo:num_hit] if b is not None)  # all cached, by the cuts above
                          for g in range(self.layout.num_groups))
        return ComputedBlocks(block_ids, num_hit * self.block_size)

    def _first_needed(self, group: int, num_blocks: int) -> int:
        """The first block group `group` reads for the token after `num_blocks` full blocks."""
        return self.layout.groups[group].first_needed_block(num_blocks * self.block_size, self.block_size)

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_COMPUTED_BLOCKS) -> list[tuple[int, int]] | None:
        """Makes room for `num_new_tokens` tokens after the request's computed ones (plus a cached
        prefix `computed`, for a request with no blocks yet), first dropping the blocks its
        sliding groups no longer read. Returns the copy-on-write block copies (src, dst) to run
        before the forward, or None, allocating nothing, if blocks are short."""
        tables = self.block_tables.get(request.request_id)
        if tables is not None and self._sliding:
            self._drop_passed(request.request_id, tables, request.num_computed_tokens)
        if tables is not None and not computed.num_tokens and self._lands_in_own_blocks(tables, request,
                                                                                         num_new_tokens):
            return []  # a decode, most steps
        plans = self._plan(request, num_new_tokens, computed)
        if self._free_blocks_taken(plans, computed) > self.pool.num_free_blocks:
            return None
        if computed.num_tokens:
            for ids in computed.block_ids:
                self.pool.touch([b for b in ids if b != NULL_BLOCK])
            tables = [list(ids) for ids in computed.block_ids]
            self._num_cached_blocks[request.request_id] = computed.num_tokens // self.block_size
            self._num_dropped[request.request_id] = [self._first_needed(g, len(ids)) if g in self._sliding else 0
                                                     for g, ids in enumerate(computed.block_ids)]
        elif tables is None:
            tables = [[] for _ in self.layout.groups]
            self._num_dropped[request.request_id] = [0] * self.layout.num_groups
        self.block_tables[request.request_id] = tables
        copies = []
        for table, (shared, num_new_blocks) in zip(tables, plans):
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
        """Free blocks `allocate_slots` would take at most: new blocks, copies of shared blocks it
        writes, and cached prefix blocks that now sit in the free queue (blocks a sliding group
        drops first are not counted back)."""
        return self._free_blocks_taken(self._plan(request, num_new_tokens, computed), computed)

    def _plan(self, request: Request, num_new_tokens: int, computed: ComputedBlocks) -> list[tuple[list[int], int]]:
        """Writing `num_new_tokens` after the request's computed tokens (and `computed`), per group:
        the indexes of its table's blocks to copy first (shared or cached ones the tokens land
        in), and the number of blocks to add (negative: that many to spare)."""
        tables = self.block_tables.get(request.request_id) or [[] for _ in self.layout.groups]
        start = request.num_computed_tokens + computed.num_tokens
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        plans = []
        for g, table in enumerate(tables):
            held = len(table) + (len(computed.block_ids[g]) if computed.num_tokens else 0)
            plans.append((self._shared(table, start // self.block_size, min(len(table), end_block)),
                          end_block - held))
        return plans

    def _lands_in_own_blocks(self, tables: Tables, request: Request, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` after the request's computed tokens land in blocks its tables
        already have, none of them to copy first: nothing to allocate or copy (a `_plan` that
        would find so, made without one for a decode's slots, most steps of most requests)."""
        start = request.num_computed_tokens
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        for table in tables:
            if end_block > len(table) or self._shared(table, start // self.block_size, end_block):
                return False
        return True

    def _shared(self, table: list[int], first: int, end: int) -> list[int]:
        """Indexes in table[first:end] of the blocks a write must copy first: another request
        holds them too, or the prefix cache does."""
        ref_cnt, block_hash = self.pool.ref_cnt, self.pool.block_hash
        shared = []
        for i in range(first, end):  # a loop: a comprehension's call costs more, per decode
            if ref_cnt[table[i]] > 1 or block_hash[table[i]] is not None:
                shared.append(i)
        return shared

    def _free_blocks_taken(self, plans: list[tuple[list[int], int]], computed: ComputedBlocks) -> int:
        """Free blocks the plans take: new blocks, a copy of each shared block, and the blocks of a
        cached prefix that sit in the free queue."""
        touched_free = 0
        if computed.num_tokens:
            ref_cnt = self.pool.ref_cnt
            touched_free = sum(1 for ids in computed.block_ids for b in ids if b != NULL_BLOCK and ref_cnt[b] == 0)
        return sum(max(num_new, 0) + len(shared) for shared, num_new in plans) + touched_free

    def _drop_passed(self, request_id: str, tables: Tables, num_computed_tokens: int) -> None:
        """Frees each sliding group's blocks before the first one the next query reads."""
        dropped = self._num_dropped[request_id]
        for g in self._sliding:
            first = self._first_needed_at(g, num_computed_tokens)
            table = tables[g]
            if first <= dropped[g]:
                continue
            passed = [b for b in table[dropped[g]:first] if b != NULL_BLOCK]
            table[dropped[g]:first] = [NULL_BLOCK] * (first - dropped[g])
            self.pool.free_blocks(passed)
            dropped[g] = first

    def _first_needed_at(self, group: int, position: int) -> int:
        return self.layout.groups[group].first_needed_block(position, self.block_size)

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens in the request's leading blocks (of its first full group) that other requests
        also hold: they survive its preemption, so recomputing them is free."""
        full = next((g for g, group in enumerate(self.layout.groups) if group.window is None), None)
        if full is None:
            return 0
        num_blocks = 0
        for block_id in self.block_tables.get(request.request_id, [[]] * (full + 1))[full]:
            if self.pool.ref_cnt[block_id] < 2:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's blocks, shared: writes to a shared block copy it first."""
        tables = [list(table) for table in self.block_tables[parent.request_id]]
        for table in tables:
            self.pool.touch([b for b in table if b != NULL_BLOCK])
        self.block_tables[child.request_id] = tables
        self._num_dropped[child.request_id] = list(self._num_dropped[parent.request_id])

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes(request)
        for g, table in enumerate(self.block_tables[request.request_id]):
            for i in range(done, num_full):
                if table[i] != NULL_BLOCK:
                    self.pool.cache_block(table[i], self._key(g, hashes[i]))
        self._num_cached_blocks[request.request_id] = num_full

    def free_beyond(self, request: Request, num_tokens: int) -> None:
        """Releases the request's blocks after those covering its first `num_tokens` positions
        (blocks that held only rejected draft tokens)."""
        keep = _cdiv(num_tokens, self.block_size)
        for table in self.block_tables[request.request_id]:
            if len(table) > keep:
                self.pool.free_blocks([b for b in reversed(table[keep:]) if b != NULL_BLOCK])
                del table[keep:]

    def free(self, request: Request) -> None:
        """Releases every block the request holds, on device and host. Tail blocks first, so a
        shared prefix outlives the blocks after it in the LRU order."""
        rid = request.request_id
        for table in self.block_tables.pop(rid, ()):
            self.pool.free_blocks([b for b in reversed(table) if b != NULL_BLOCK])
        for table in self.host_tables.pop(rid, ()):
            self.host_pool.free([b for b in table if b != NULL_BLOCK])
        self._num_cached_blocks.pop(rid, None)
        self._num_dropped.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drops per-request hash state once the request has ended."""
        self._block_hashes.pop(request.request_id, None)

    # ---- swap ----------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the request's blocks to the host pool: returns (device, host) pairs to copy, or
        None, changing nothing, when the host pool is too small."""
        tables = self.block_tables[request.request_id]
        held = [b for table in tables for b in table if b != NULL_BLOCK]
        if len(held) > self.host_pool.num_free_blocks:
            return None
        host_ids = iter(self.host_pool.allocate(len(held)))
        self.host_tables[request.request_id] = [[b if b == NULL_BLOCK else next(host_ids) for b in table]
                                                for table in tables]
        for table in self.block_tables.pop(request.request_id):
            self.pool.free_blocks([b for b in reversed(table) if b != NULL_BLOCK])
        self._num_cached_blocks.pop(request.request_id, None)
        host = [b for table in self.host_tables[request.request_id] for b in table if b != NULL_BLOCK]
        return list(zip(held, host))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Brings a swapped request's blocks back: returns (host, device) pairs, or None."""
        host_tables = self.host_tables[request.request_id]
        host = [b for table in host_tables for b in table if b != NULL_BLOCK]
        if len(host) > self.pool.num_free_blocks:
            return None
        device_ids = iter(self.pool.get_new_blocks(len(host)))
        self.block_tables[request.request_id] = [[b if b == NULL_BLOCK else next(device_ids) for b in table]
                                                 for table in host_tables]
        for table in self.host_tables.pop(request.request_id):
            self.host_pool.free([b for b in table if b != NULL_BLOCK])
        device = [b for table in self.block_tables[request.request_id] for b in table if b != NULL_BLOCK]
        return list(zip(host, device))

    def num_blocks_to_resume(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks a swapped request needs to swap in and compute `num_new_tokens` more."""
        end_block = _cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(sum(b != NULL_BLOCK for b in table) + max(0, end_block - len(table))
                   for table in self.host_tables[request.request_id])

    def check_integrity(self) -> None:
        """Asserts exact accounting: device ref counts equal owners, host blocks owned once."""
        owners = Counter(b for tables in self.block_tables.values() for table in tables for b in table
                         if b != NULL_BLOCK)
        self.pool.check_integrity(owners)
        self.host_pool.check_integrity([b for tables in self.host_tables.values() for table in tables for b in table
                                        if b != NULL_BLOCK])
