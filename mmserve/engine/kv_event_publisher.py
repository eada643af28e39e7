"""KV cache events on the wire, in vLLM's format, so vllm-router's `kv_aware` policy and other prefix-aware
routers see what this replica's prefix cache holds.

Wire (vLLM's `ZmqEventPublisher`): a PUB socket sends one multipart message per engine step that changed the
cache, `[topic, seq (8-byte big-endian), payload]`; the payload is msgpack `[ts, [event, ...], data_parallel_rank]`
with each event a map tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Sequence numbers
count from 0 in each process, so a subscriber that sees them go back knows the replica restarted. With a replay
endpoint, a ROUTER socket answers `[identity, b"", start_seq]` with every buffered `[identity, b"", seq, payload]`
from `start_seq` on, then `[identity, b"", -1, b""]`.

The engine core calls `publish` (never blocks); a thread owns the sockets (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from mmserve.config import KVEventsConfig
from mmserve.scheduler import kv_events

logger = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_WAIT_S = 0.1  # the thread's longest sleep with nothing to send (and no replay socket)
_REPLAY_POLL_MS = 10  # with a replay socket: how long it waits for a request before looking at the queue again


# vLLM's structs (vllm/distributed/kv_events.py): the field names are the wire format. Every field is sent,
# None included (vllm-router refuses an event that lacks one).
class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None  # per block: the mm_hashes in its hash
    group_idx: int | None = None  # the KV cache group (one group here: full attention)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# vLLM's `medium` names a tier of its KV hierarchy, not a device: "GPU" is the pool attention reads directly,
# "CPU" a host offload tier that routers discount (vllm-router credits it 0.8 of a direct hit). mmserve has one
# pool, the one attention reads, on the GPU or the CPU alike: its blocks are always the first tier.
MEDIUM = "GPU"


def to_wire(events: list[kv_events.KVCacheEvent], medium: str = MEDIUM) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The scheduler's events as vLLM's structs."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in events:
        if isinstance(event, kv_events.BlockStored):
            extra = [list(keys) if keys else None for keys in event.extra_keys]
            out.append(BlockStored(list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                                   event.block_size, medium=medium,
                                   extra_keys=extra if any(extra) else None))  # fmt: skip
        elif isinstance(event, kv_events.BlockRemoved):
            out.append(BlockRemoved(list(event.block_hashes), medium=medium))
        else:
            out.append(AllBlocksCleared())
    return out


def _binds(endpoint: str) -> bool:
    """vLLM's rule, widened to loopback: bind a wildcard, loopback, ipc:// or inproc:// address (a subscriber
    connects to it); connect to anything else (a forwarding proxy)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("*", "::", "0.0.0.0", "localhost"):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


class KVEventPublisher:
    """Owns the PUB (and replay ROUTER) sockets on a thread. `publish` from the engine core, `close` once."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self._queue: queue.Queue[list[kv_events.KVCacheEvent] | None] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        self._stopped = threading.Event()
        self.num_dropped = 0  # batches lost because the sending thread fell behind
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv_events_config: cannot open {config.endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queue one step's events (a no-op for none). Never blocks: when the queue is full the oldest batch is
        dropped, and a subscriber sees the gap in the sequence numbers."""
        if not events or self._stopped.is_set():
            return
        while True:
            try:
                self._queue.put_nowait(events)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
                    self.num_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to `timeout_s`), then close the sockets."""
        if self._stopped.is_set():
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        self._stopped.set()
        if not self._thread.is_alive():
            self._close_sockets()

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        buffer: deque[tuple[bytes, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._stopped.is_set():
                try:
                    events = self._queue.get(timeout=0 if self._replay is not None else _WAIT_S)
                except queue.Empty:
                    events = ...
                if events is None:
                    return
                if events is not ...:
                    batch = KVEventBatch(time.time(), to_wire(events), self.data_parallel_rank)
                    payload = encoder.encode(batch)
                    seq_bytes = seq.to_bytes(8, "big")
                    seq += 1
                    buffer.append((seq_bytes, payload))
                    with contextlib.suppress(zmq.Again):
                        self._pub.send_multipart((topic, seq_bytes, payload), zmq.NOBLOCK)
                    continue  # drain the queue before waiting on the replay socket
                if self._replay is not None and poller.poll(_REPLAY_POLL_MS):
                    self._answer_replay(buffer)
        except zmq.ZMQError:
            if not self._stopped.is_set():
                logger.exception("the KV event publisher stopped")

    def _answer_replay(self, buffer: deque[tuple[bytes, bytes]]) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq_bytes, payload in list(buffer):
                if int.from_bytes(seq_bytes, "big") >= start:
                    self._replay.send_multipart((identity, b"", seq_bytes, payload))
            self._replay.send_multipart((identity, b"", _END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
