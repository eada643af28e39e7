"""KV cache manager unit tests: allocation, ref counts, prefix hits, LRU eviction. Torch-free."""

from __future__ import annotations

from mmserve.request import Request, SamplingParams
from mmserve.scheduler.kv_cache_manager import KVCacheManager, hash_block


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def admit(kv: KVCacheManager, r: Request) -> list[int] | None:
    """Admit like the scheduler does: prefix hits first, then the rest of the prompt."""
    hits, num_cached = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_cached, hits)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return new


def test_allocation_rounds_up_to_blocks_and_free_returns_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(9)))
    assert len(admit(kv, r)) == 3
    assert kv.num_free_blocks == 5
    assert kv.allocate_slots(r, 3) == []  # tokens 9..11 fit in the third block
    r.num_computed_tokens = 12  # the scheduler advances it once the grant is planned
    assert len(kv.allocate_slots(r, 1)) == 1
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert admit(kv, r) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_shared_prefix_is_ref_counted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = req("a", list(range(10))), req("b", [*range(8), 50, 51, 52])
    admit(kv, a)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.block_ids("a")[:2]
    admit(kv, b)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_free_blocks == 8 - 3 - 1
    kv.free(a)
    assert kv.num_free_blocks == 8 - 3  # shared blocks still held by b
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    _, n = kv.get_computed_blocks(req("b", list(range(8))))
    assert n == 4


def test_freed_cached_blocks_are_revived_until_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4  # cached blocks count as free
    b = req("b", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.num_free_blocks == 1
    kv.free(b)
    # Filling the whole pool with other content evicts the cached prefix.
    c = req("c", list(range(100, 108)))
    admit(kv, c)
    kv.free(c)
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5]))[1] == 0


def test_eviction_takes_tail_blocks_before_prefix_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    admit(kv, a)
    kv.free(a)
    # Two blocks are needed: the unhashed partial block goes first, then the tail of the chain.
    x = req("x", [9, 9, 9])
    admit(kv, x)
    assert kv.get_computed_blocks(req("y", [1, 2, 3, 4, 5, 6, 7, 8]))[1] == 4
    kv.free(x)
    z = req("z", [8, 8, 8])
    admit(kv, z)
    assert kv.get_computed_blocks(req("y", [1, 2, 3, 4, 5, 6, 7, 8]))[1] == 2


def test_decode_tokens_fill_and_publish_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    admit(kv, a)
    a.append_output_token(4)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    a.append_output_token(5)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5]))[1] == 4


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_block_hash_chains_over_parent_and_extra_keys() -> None:
    h1 = hash_block(b"", [1, 2])
    assert hash_block(b"", [1, 2]) == h1
    assert hash_block(h1, [1, 2]) != h1
    assert hash_block(b"", [1, 2], ("img",)) != h1
    assert hash_block(b"", [1, 2], ("a",)) != hash_block(b"", [1, 2], ("b",))
