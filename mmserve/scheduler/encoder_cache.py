"""Encoder cache bookkeeping: which (mm_hash, temporal group) embeddings exist, who still needs
them, and how much room is left. Torch-free; the tensors live in the model runner.

An entry is referenced by every request whose prompt still has uncomputed tokens in that group.
Unreferenced entries stay cached (least recently used first out) until their room is needed, so
the same image in a later request is not encoded again; evicted keys go to the runner in the
plan that evicted them, and it drops them before encoding that plan's work.

A group encoded in slices of the tower's blocks is *partial* until its last slice: the runner keeps its
hidden states, this manager how many blocks have run and which live requests advanced it. When none is
left (they finished or were preempted), the key goes to the runner one plan later, so that a slice
already planned in the plan that dropped it still finds its state (and leaves none behind).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from mmserve.request import MultiModalInput
from mmserve.scheduler.output import encoder_work_tokens

EncoderKey = tuple[str, int]  # (mm_hash, temporal group index)


class EncoderGrant(NamedTuple):
    """One temporal group a step's chunk needs, as the scheduler plans it."""

    mm: MultiModalInput
    group: int
    cached: bool  # in the encoder cache already: shared, not encoded
    charge: int  # tokens of the step's token budget its encoding takes (SchedulerConfig.encoder_token_cost)
    loaded: bool = False  # not cached, but an encoder instance computed it: loaded, not encoded
    # Encoded in a slice of the tower: (first, end, depth), as EncoderWork.blocks; None: the whole tower.
    # A slice that ends before `depth` grants no token of its group.
    blocks: tuple[int, int, int] | None = None

    @property
    def num_tokens_computed(self) -> float:
        """Embedding tokens' worth of encoder work (0 for cached and loaded groups; a slice by its share)."""
        return 0.0 if self.cached or self.loaded else encoder_work_tokens(self.mm.tokens_per_group, self.blocks)


def new_encoder_tokens(plan: Iterable[EncoderGrant]) -> float:
    """Embedding tokens the encoder must compute for a plan (cached and loaded groups cost nothing)."""
    return sum(g.num_tokens_computed for g in plan)


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # embedding tokens
        self._size: dict[EncoderKey, int] = {}  # every cached entry
        self._refs: dict[EncoderKey, set[str]] = {}  # referenced entries only
        self._held: dict[str, set[EncoderKey]] = {}  # request id -> keys it references
        self._unreferenced: OrderedDict[EncoderKey, None] = OrderedDict()  # eviction order, oldest first
        self._evicted: list[EncoderKey] = []  # since the last plan
        self.num_cached_tokens = 0  # referenced or not
        self.num_referenced_tokens = 0
        self.num_hit_tokens = 0  # embeddings served from the cache instead of the encoder
        self.num_computed_tokens = 0  # embeddings the encoder was asked to compute
        self.num_loaded_tokens = 0  # embeddings loaded from an encoder instance's output instead
        self._blocks_done: dict[EncoderKey, int] = {}  # partial groups: tower blocks run so far
        self._advanced_by: dict[EncoderKey, set[str]] = {}  # partial groups: live requests that advanced them
        self._orphaned: list[EncoderKey] = []  # partial groups no live request advances any more
        self._orphans_due: list[EncoderKey] = []  # of those, the ones the plan being made evicts

    @property
    def num_partial(self) -> int:
        """Groups part-way through the tower (the runner holds their hidden states)."""
        return len(self._blocks_done)

    def blocks_done(self, key: EncoderKey) -> int:
        """Tower blocks already run over a group encoded in slices (0: none, or not partial)."""
        return self._blocks_done.get(key, 0)

    def is_partial(self, key: EncoderKey) -> bool:
        return key in self._blocks_done

    def advance(self, request_id: str, key: EncoderKey, end_block: int) -> None:
        """A slice of a group's encode that ends before the tower's last block is planned (by `request_id`)."""
        self._blocks_done[key] = end_block
        self._advanced_by.setdefault(key, set()).add(request_id)
        for orphans in (self._orphaned, self._orphans_due):
            if key in orphans:
                orphans.remove(key)

    def has_pending_evictions(self) -> bool:
        """Partial groups to drop that only the next plan can tell the runner about."""
        return bool(self._orphaned or self._orphans_due)

    @property
    def num_entries(self) -> int:
        return len(self._size)

    def is_cached(self, key: EncoderKey) -> bool:
        return key in self._size

    def is_referenced(self, key: EncoderKey) -> bool:
        return key in self._refs

    def reset(self) -> None:
        """Forget every entry and reference (after a failed step, whose work may not have run)."""
        for container in (self._size, self._refs, self._held, self._unreferenced, self._blocks_done, self._advanced_by):
            container.clear()
        self._evicted.clear()
        self._orphaned.clear()
        self._orphans_due.clear()
        self.num_cached_tokens = self.num_referenced_tokens = 0

    def held_keys(self, request_id: str) -> frozenset[EncoderKey]:
        return frozenset(self._held.get(request_id, ()))

    def holds(self, request_id: str, key: EncoderKey) -> bool:
        return key in self._held.get(request_id, ())

    def room(self) -> int:
        """Tokens a new entry may take: everything not referenced can be evicted for it."""
        return self.capacity - self.num_referenced_tokens

    def add(self, request_id: str, key: EncoderKey, num_tokens: int, loaded: bool = False) -> None:
        """Make room (evicting unreferenced entries) for a new entry the runner computes this step (or, `loaded`,
        loads from an encoder instance's output)."""
        while self.num_cached_tokens + num_tokens > self.capacity and self._unreferenced:
            old, _ = self._unreferenced.popitem(last=False)
            self.num_cached_tokens -= self._size.pop(old)
            self._evicted.append(old)
        self._size[key] = num_tokens
        self.num_cached_tokens += num_tokens
        self._blocks_done.pop(key, None)  # its last slice: the runner caches the result and drops the state
        self._advanced_by.pop(key, None)
        if loaded:
            self.num_loaded_tokens += num_tokens
        else:
            self.num_computed_tokens += num_tokens
        self._ref(request_id, key)

    def share(self, request_id: str, key: EncoderKey) -> None:
        """Reference an entry that is already cached (a hit)."""
        self.num_hit_tokens += self._size[key]
        self._ref(request_id, key)

    def release(self, request_id: str, key: EncoderKey) -> None:
        held = self._held.get(request_id)
        if held is None or key not in held:
            return
        held.discard(key)
        if not held:
            del self._held[request_id]
        refs = self._refs[key]
        refs.discard(request_id)
        if not refs:
            del self._refs[key]
            self.num_referenced_tokens -= self._size[key]
            self._unreferenced[key] = None

    def release_all(self, request_id: str) -> None:
        """The request is finished or preempted: its references, and the partial groups only it advanced."""
        for key in list(self._held.get(request_id, ())):
            self.release(request_id, key)
        for key, requests in list(self._advanced_by.items()):
            requests.discard(request_id)
            if not requests:
                del self._advanced_by[key], self._blocks_done[key]
                self._orphaned.append(key)

    def take_evicted(self) -> list[EncoderKey]:
        """Keys the runner must drop before this plan's work: evicted entries, and partial groups orphaned
        before the previous plan (that plan may still have run a slice of them)."""
        evicted, self._evicted = self._evicted, []
        due, self._orphans_due = self._orphans_due, []
        return evicted + due

    def begin_plan(self) -> None:
        """A plan is being made: partial groups orphaned before it are evicted by it (unless it advances them
        again); those orphaned while it is made wait for the next one."""
        self._orphans_due += self._orphaned
        self._orphaned = []

    def _ref(self, request_id: str, key: EncoderKey) -> None:
        refs = self._refs.setdefault(key, set())
        if not refs:
            self._unreferenced.pop(key, None)
            self.num_referenced_tokens += self._size[key]
        refs.add(request_id)
        self._held.setdefault(request_id, set()).add(key)
