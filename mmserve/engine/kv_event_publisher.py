"""KV cache events on the wire in vLLM's format, so vllm-router's `kv_aware` policy and other prefix-aware
routers see what this replica's prefix cache holds.

Wire (vLLM's `ZmqEventPublisher`): a PUB socket sends one multipart message per engine step that changed the
cache, `[topic, seq (8-byte big-endian), payload]`; the payload is msgpack `[ts, [event, ...], data_parallel_rank]`
with each event a map tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) — the current vLLM
encoding, and the only one vllm-router 0.1.17 accepts ("KV event must be a tagged map"); older vLLM releases,
and subscribers written against them, encode each event as a positional array instead. Sequence numbers count
from 0 in each process, so a subscriber that sees them go back knows the replica restarted, and one that sees
a gap knows it missed batches. With a replay endpoint, a ROUTER socket answers `[identity, b"", start_seq]`
with every buffered `[identity, b"", seq, payload]` from `start_seq` on, then `[identity, b"", -1, b""]`.

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
_POLL_MS = 10  # how long the thread waits on its sockets before looking at the queue again


# vLLM's structs (vllm/distributed/kv_events.py): the field names are the wire format (its lists are tuples
# here: the same msgpack arrays). Every field is sent, None included (vllm-router refuses an event that lacks one).
class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None  # per block: the mm_hashes in its hash
    group_idx: int | None = None  # the KV cache group (one group here: full attention)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: tuple[bytes, ...]
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


def to_wire(events: list[kv_events.KVCacheEvent]) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The scheduler's events as vLLM's structs."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in events:
        if isinstance(event, kv_events.BlockStored):
            extra = event.extra_keys if any(event.extra_keys) else None
            out.append(BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                   medium=MEDIUM, extra_keys=extra))  # fmt: skip
        elif isinstance(event, kv_events.BlockRemoved):
            out.append(BlockRemoved(event.block_hashes, medium=MEDIUM))
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
    """Owns the PUB (and replay ROUTER) sockets on a thread. `publish` from the engine core's thread, `close`
    once. A batch is numbered when it is published, so one dropped before it is sent leaves a gap a subscriber
    sees."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self._queue: queue.Queue[tuple[int, list[kv_events.KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._next_seq = 0
        self.num_dropped = 0  # batches lost because the sending thread fell behind
        self._closing = threading.Event()
        self._snapshot_requested = threading.Event()
        self._context = zmq.Context()
        # XPUB: a PUB socket that also hears each subscription (verbose: every subscriber's, not the first one
        # per topic), so a subscriber that joins is sent the whole cache (`take_snapshot_request`).
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        endpoint = config.endpoint
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if config.replay_endpoint is not None:
                endpoint = config.replay_endpoint
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv_events_config: cannot open {endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queue one step's events (a no-op for none). Never blocks: when the queue is full the oldest batch is
        dropped (its sequence number is then missing on the wire)."""
        if not events or self._closing.is_set() or not self._thread.is_alive():
            return
        item = (self._next_seq, events)
        self._next_seq += 1
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
                    self.num_dropped += 1
                    if self.num_dropped % 1000 == 1:
                        logger.warning("KV event publisher behind: %d batches dropped so far", self.num_dropped)

    def take_snapshot_request(self) -> bool:
        """Whether a subscriber joined since the last call: then the caller publishes the whole cache
        (`KVCacheManager.snapshot_events`) in place of its pending events, which the snapshot includes."""
        if not self._snapshot_requested.is_set():
            return False
        self._snapshot_requested.clear()
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to `timeout_s`); the thread then closes the sockets. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Until `close`: send each queued batch; answer replay requests between batches. Closes the sockets."""
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        # Replay buffer: (seq, payload) of the last buffer_steps batches (kept only with a replay socket).
        buffer: deque[tuple[bytes, bytes]] = deque(maxlen=self.config.buffer_steps if self._replay else 0)
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)  # subscriptions
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    ready = dict(poller.poll(_POLL_MS))
                    if self._pub in ready:
                        self._read_subscriptions()
                    if self._replay is not None and self._replay in ready:
                        self._answer_replay(buffer)
                    continue
                if item is None:
                    return
                seq, events = item
                payload = encoder.encode(KVEventBatch(time.time(), to_wire(events), self.data_parallel_rank))
                seq_bytes = seq.to_bytes(8, "big")
                buffer.append((seq_bytes, payload))
                with contextlib.suppress(zmq.Again):
                    self._pub.send_multipart((topic, seq_bytes, payload), zmq.NOBLOCK)
        except Exception:  # events stop (publish becomes a no-op); serving goes on
            logger.exception("the KV event publisher stopped")
        finally:
            self._close_sockets()

    def _read_subscriptions(self) -> None:
        """XPUB frames: b"\x01" + topic when a subscriber subscribes, b"\x00" + topic when it leaves."""
        while True:
            try:
                frame = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frame[:1] == b"\x01":
                self._snapshot_requested.set()

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
