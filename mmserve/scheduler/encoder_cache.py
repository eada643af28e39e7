"""Encoder cache bookkeeping: which (mm_hash, temporal group) embeddings exist, who still needs
them, and how much room is left. Torch-free; the tensors live in the model runner.

An entry is referenced by every request whose prompt still has uncomputed tokens in that group.
Unreferenced entries stay cached (least recently used first out) until their room is needed, so
the same image in a later request is not encoded again; evicted keys go to the runner in the
plan that evicted them, and it drops them before encoding that plan's work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from mmserve.request import MultiModalInput

EncoderKey = tuple[str, int]  # (mm_hash, temporal group index)


class EncoderGrant(NamedTuple):
    """One temporal group a step's chunk needs, as the scheduler plans it."""

    mm: MultiModalInput
    group: int
    cached: bool  # in the encoder cache already: shared, not encoded
    charge: int  # tokens of the step's token budget its encoding takes (SchedulerConfig.encoder_token_cost)
    loaded: bool = False  # not cached, but an encoder instance computed it: loaded, not encoded


def new_encoder_tokens(plan: Iterable[EncoderGrant]) -> int:
    """Embedding tokens the encoder must compute for a plan (cached and loaded groups cost nothing)."""
    return sum(g.mm.tokens_per_group for g in plan if not g.cached and not g.loaded)


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

    @property
    def num_entries(self) -> int:
        return len(self._size)

    def is_cached(self, key: EncoderKey) -> bool:
        return key in self._size

    def is_referenced(self, key: EncoderKey) -> bool:
        return key in self._refs

    def reset(self) -> None:
        """Forget every entry and reference (after a failed step, whose work may not have run)."""
        for container in (self._size, self._refs, self._held, self._unreferenced):
            container.clear()
        self._evicted.clear()
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
        for key in list(self._held.get(request_id, ())):
            self.release(request_id, key)

    def take_evicted(self) -> list[EncoderKey]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def _ref(self, request_id: str, key: EncoderKey) -> None:
        refs = self._refs.setdefault(key, set())
        if not refs:
            self._unreferenced.pop(key, None)
            self.num_referenced_tokens += self._size[key]
        refs.add(request_id)
        self._held.setdefault(request_id, set()).add(key)
