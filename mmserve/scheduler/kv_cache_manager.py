"""KV block bookkeeping: which request holds which blocks, ref counts, prefix-cache hashes, LRU reuse.

Owns block ids only; the tensors live in the model runner. Torch-free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from mmserve.request import Request
from mmserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def hash_block(parent_hash: bytes, token_ids: list[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Chain hash of one full block: parent hash, its token ids and the media items it overlaps.

    Media hashes make two prompts with the same placeholder tokens but different images differ.
    """
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Fixed-size blocks in one pool. A block is free when no request holds it (ref count 0).

    Free blocks sit in `_free` in eviction order (front first). A free block may still carry a
    prefix hash, so a later request can take it back with its contents; it loses the hash only
    when it is handed out for new tokens.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id holding that content
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._req_blocks: dict[str, list[int]] = {}
        self._req_num_hashed: dict[str, int] = {}  # leading blocks of a request already registered
        self.peak_num_used_blocks = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Hashes in and out of `_cached`, in order, until `take_events` (None: nobody listens).
        self._events: list[KVCacheEvent] | None = [] if enable_kv_events and enable_prefix_caching else None
        # With events: what each cached hash was announced with (parent hash, its block_size token ids, its
        # media keys), so `snapshot_events` can announce the whole cache again to a subscriber that joins late.
        self._announced: dict[bytes, tuple[bytes | None, tuple[int, ...], tuple[str, ...] | None]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request not yet running: (block ids, number of tokens).

        At least one token is left to compute, so the step that finishes the prompt has logits.
        A request that already holds blocks while waiting (`fork`) starts from those instead.
        """
        held = self._req_blocks.get(request.request_id)
        if held:
            return [], request.num_computed_tokens
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cached_block_hashes(self) -> frozenset[bytes]:
        """The hashes a new request can hit now (what the KV events announce)."""
        return frozenset(self._cached)

    def snapshot_events(self) -> list[KVCacheEvent]:
        """The cache as events: `AllBlocksCleared`, then a `BlockStored` for every cached hash, each after its
        parent's (depth first from the chains' first blocks, so a chain's blocks share events). A subscriber
        that applies them holds exactly `cached_block_hashes()`."""
        if self._events is None:
            return []
        children: dict[bytes | None, list[bytes]] = {}
        for block_hash, (parent, _, _) in self._announced.items():
            children.setdefault(parent if parent in self._announced else None, []).append(block_hash)
        order: list[bytes] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            block_hash = stack.pop()
            order.append(block_hash)
            stack.extend(reversed(children.get(block_hash, [])))
        return [AllBlocksCleared(), *self._stored_events(order)]

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (empty when KV events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- changes ---------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None, publish: bool = True
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if blocks run out.

        `computed_blocks` are prefix-cache hits for a request being admitted; they are taken
        in front of any new block. `publish=False`: the new blocks' hashes are not published yet, because
        their content arrives later (a remote prefill's read); `publish_computed` does it then.
        """
        computed_blocks = computed_blocks or []
        held = self._req_blocks.setdefault(request.request_id, [])
        num_tokens_after = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = cdiv(num_tokens_after, self.block_size) - len(held) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self._ref_cnt[b] == 0)
        if num_needed > len(self._free) - num_revived:
            if not held:
                del self._req_blocks[request.request_id]
            return None
        for block_id in computed_blocks:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1
        new_blocks = [self._pop_free_block() for _ in range(max(num_needed, 0))]
        held.extend(computed_blocks)
        held.extend(new_blocks)
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, self.num_blocks - len(self._free))
        if self.enable_prefix_caching and publish:
            self._register_full_blocks(request, num_tokens_after)
        return new_blocks

    def publish_computed(self, request: Request, num_tokens: int) -> None:
        """The request's first `num_tokens` tokens are now in its blocks (a remote prefill's read ended):
        publish the hashes of the full ones."""
        if self.enable_prefix_caching:
            self._register_full_blocks(request, num_tokens)

    def fork(self, parent: Request, child: Request) -> int:
        """Let a waiting `child` with the same prompt share the parent's full prompt blocks, whose KV is
        written (the parent's prefill is done): the child holds a reference to each and starts with
        them as computed. The block holding the prompt's last token is not shared, so the child still
        computes that token (its own logits) and writes into blocks of its own. Returns the tokens shared."""
        if child.request_id in self._req_blocks or child.prompt_token_ids != parent.prompt_token_ids:
            return 0
        num_shared = (child.num_prompt_tokens - 1) // self.block_size
        blocks = self._req_blocks.get(parent.request_id, [])[:num_shared]
        if not blocks or len(blocks) < num_shared or parent.num_computed_tokens < num_shared * self.block_size:
            return 0
        for block_id in blocks:
            self._ref_cnt[block_id] += 1  # held by the parent: never on the free list
        self._req_blocks[child.request_id] = list(blocks)  # registered (or not) by the parent already
        child.num_computed_tokens = num_shared * self.block_size
        return child.num_computed_tokens

    def free(self, request: Request) -> None:
        """Release a request's blocks. Tail blocks are freed first, so they are evicted first."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_num_hashed.pop(request.request_id, None)
        # Blocks past num_computed_tokens were published for a grant that never ran (a victim
        # preempted in the step that granted it): their content is not what the hash says.
        num_written = request.num_computed_tokens // self.block_size
        for index in range(num_written, len(blocks)):
            block_id, block_hash = blocks[index], self._block_hash[blocks[index]]
            if block_hash is not None and self._ref_cnt[block_id] == 1:
                self._uncache(block_id, block_hash)
        for block_id in reversed(blocks):
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)  # worthless content: reuse first

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change)."""
        if self._events is not None and self._cached:
            self._events.append(AllBlocksCleared())
        self._announced.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._req_num_hashed = dict.fromkeys(self._req_num_hashed, 0)

    # -- internals -------------------------------------------------------------------------------
    def _pop_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            self._uncache(block_id, block_hash)
        self._ref_cnt[block_id] = 1
        return block_id

    def _uncache(self, block_id: int, block_hash: bytes) -> None:
        """The block's content no longer counts as `block_hash` (it will be overwritten, or never was written)."""
        if self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
            self._announced.pop(block_hash, None)
            if self._events is not None:
                last = self._events[-1] if self._events else None
                if isinstance(last, BlockRemoved):  # one event for a run of removals
                    self._events[-1] = BlockRemoved((*last.block_hashes, block_hash))
                else:
                    self._events.append(BlockRemoved((block_hash,)))
        self._block_hash[block_id] = None

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the hashes of the request's blocks that are full once `num_tokens` are computed."""
        num_full = (
            min(num_tokens, request.num_tokens) // self.block_size
        )  # only blocks whose tokens are known
        start = self._req_num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        held = self._req_blocks[request.request_id]
        stored: list[int] = []  # indices of the blocks whose hash entered the cache now
        for i in range(start, num_full):
            block_hash = request.block_hashes[i]
            if block_hash not in self._cached and self._block_hash[held[i]] is None:
                self._cached[block_hash] = held[i]
                self._block_hash[held[i]] = block_hash
                stored.append(i)
        self._req_num_hashed[request.request_id] = num_full
        if self._events is not None and stored:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """Announce the blocks at `indices` of `request` (ascending) whose hashes entered the cache."""
        bs, hashes = self.block_size, request.block_hashes
        for i in indices:
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            keys = self._block_mm_hashes(request, i, bs) or None
            self._announced[hashes[i]] = (hashes[i - 1] if i else None, tokens, keys)
        self._events.extend(self._stored_events([hashes[i] for i in indices]))

    def _stored_events(self, block_hashes: list[bytes], max_blocks_per_event: int = 1024) -> list[BlockStored]:
        """`BlockStored`s for announced hashes given parents first: a hash whose parent is the one before it
        joins that one's event (up to `max_blocks_per_event` blocks)."""
        runs: list[list[bytes]] = []
        for block_hash in block_hashes:
            if runs and self._announced[block_hash][0] == runs[-1][-1] and len(runs[-1]) < max_blocks_per_event:
                runs[-1].append(block_hash)
            else:
                runs.append([block_hash])
        return [
            BlockStored(
                block_hashes=tuple(run),
                parent_block_hash=self._announced[run[0]][0],
                token_ids=tuple(t for h in run for t in self._announced[h][1]),
                block_size=self.block_size,
                extra_keys=tuple(self._announced[h][2] for h in run),
            )
            for run in runs
        ]

    @staticmethod
    def _block_mm_hashes(request: Request, index: int, block_size: int) -> tuple[str, ...]:
        start, end = index * block_size, (index + 1) * block_size
        return tuple(
            mm.mm_hash
            for mm in request.mm_inputs
            if mm.placeholder.offset < end and start < mm.placeholder.offset + mm.placeholder.length
        )

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[i - 1] if i else b""
            extra = self._block_mm_hashes(request, i, bs)
            hashes.append(hash_block(parent, request.all_token_ids[i * bs : (i + 1) * bs], extra))
