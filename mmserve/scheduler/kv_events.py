"""What the prefix cache gained and lost, as the KV cache manager records it: the events a replica publishes so
that a router can route by what each replica really holds (`engine/kv_event_publisher.py` puts them on the wire
in vLLM's format). Torch-free and wire-free.

A hash is the 32-byte chain hash of one full block (`kv_cache_manager.hash_block`). Every hash that enters the
cache is announced by one `BlockStored`, and the same hash leaves it by one `BlockRemoved` (or an
`AllBlocksCleared`), so a subscriber that applies the events in order holds exactly the manager's set of hashes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one request whose hashes entered the cache: block i's parent is block i - 1, the
    first one's is `parent_block_hash` (None: the first block of its prompt)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]  # block_size tokens per block, in block order
    block_size: int
    # Per block: the `mm_hash`es of the media items it overlaps (None: a text-only block). They are part of
    # the block's hash, so a router that rebuilds hashes from tokens needs them.
    extra_keys: tuple[tuple[str, ...] | None, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Hashes that left the cache: their blocks were reused for other tokens, or never written."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash left the cache (a prefix-cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
