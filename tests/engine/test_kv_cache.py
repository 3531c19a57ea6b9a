"""Block pool and KV manager: exact block ids, ref counts, LRU eviction, copy-on-write, swap."""
from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def test_pool_reuses_uncached_blocks_first_and_evicts_cached_lru():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert a == [0, 1, 2]
    pool.cache_block(0, 100)
    pool.cache_block(1, 101)
    pool.free_blocks([2, 1, 0])  # tail first, as the manager frees
    assert list(pool.free_queue) == [2, 3, 1, 0]  # uncached block 2 first, cached ones last
    assert pool.get_new_blocks(3) == [2, 3, 1]  # block 1 evicted: its hash is gone
    assert pool.get_cached_block(101) is None and pool.get_cached_block(100) == 0
    assert pool.num_evictions == 1


def test_prefix_cache_hit_shares_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    assert kv.allocate_slots(first, 10) == []
    first.num_computed_tokens = 10
    kv.cache_full_blocks(first)
    second = _request("b", list(range(1, 9)))  # 8 tokens = exactly the 2 cached blocks
    hit = kv.get_computed_blocks(second)
    assert hit.block_ids == ((0,),) and hit.num_tokens == 4  # the last block is recomputed for logits
    assert kv.allocate_slots(second, 4, hit) == []
    assert kv.block_tables["b"][0] == [0, 3] and kv.pool.ref_cnt[0] == 2
    kv.check_integrity()


def test_fork_shares_blocks_and_write_copies_the_shared_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = _request("p", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.append_token(9)
    child = parent.fork(1)
    kv.fork(parent, child)
    assert kv.block_tables["p"][0] == kv.block_tables[child.request_id][0] == [0, 1]
    assert kv.allocate_slots(child, 1) == [(1, 2)]  # writing position 5 copies block 1
    assert kv.block_tables[child.request_id][0] == [0, 2] and kv.pool.ref_cnt[1] == 1 and kv.pool.ref_cnt[0] == 2
    assert kv.allocate_slots(parent, 1) == []  # parent owns block 1 alone now: written in place
    kv.check_integrity()


def test_swap_out_and_in_moves_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=3)
    req = _request("s", list(range(1, 10)))
    kv.allocate_slots(req, 9)
    assert kv.swap_out(req) == [(0, 0), (1, 1), (2, 2)]
    assert kv.num_free_blocks == 4 and kv.host_pool.num_free_blocks == 0
    kv.check_integrity()
    assert kv.swap_in(req) is not None and kv.host_pool.num_free_blocks == 3
    assert len(kv.block_tables["s"][0]) == 3
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 4


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = _request("x", list(range(1, 13)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2
    kv.check_integrity()
