"""Encoder cache bookkeeping: which (mm_hash, temporal group) embeddings exist, who still needs
them, and how much room is left. Torch-free; the tensors live in the model runner.

An entry is referenced by every request whose prompt still has uncomputed tokens in that group,
and is freed when the last reference goes (the runner drops it at the start of the next step).
"""

from __future__ import annotations

EncoderKey = tuple[str, int]  # (mm_hash, temporal group index)


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # embedding tokens
        self.num_used = 0
        self._size: dict[EncoderKey, int] = {}
        self._refs: dict[EncoderKey, set[str]] = {}
        self._held: dict[str, set[EncoderKey]] = {}  # request id -> keys it references
        self._to_free: list[EncoderKey] = []  # released since the last plan
        self.num_hit_tokens = 0  # embeddings served from the cache instead of the encoder
        self.num_computed_tokens = 0  # embeddings the encoder was asked to compute

    @property
    def num_entries(self) -> int:
        return len(self._size)

    def is_cached(self, key: EncoderKey) -> bool:
        return key in self._size

    def holds(self, request_id: str, key: EncoderKey) -> bool:
        return key in self._held.get(request_id, ())

    def has_room(self, num_tokens: int) -> bool:
        return self.num_used + num_tokens <= self.capacity

    def add(self, request_id: str, key: EncoderKey, num_tokens: int) -> None:
        """Reserve room for a new entry the runner will compute this step."""
        self._size[key] = num_tokens
        self.num_used += num_tokens
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
            self.num_used -= self._size.pop(key)
            self._to_free.append(key)

    def release_all(self, request_id: str) -> None:
        for key in list(self._held.get(request_id, ())):
            self.release(request_id, key)

    def take_freed(self) -> list[EncoderKey]:
        freed, self._to_free = self._to_free, []
        return freed

    def _ref(self, request_id: str, key: EncoderKey) -> None:
        self._refs.setdefault(key, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(key)
