"""The worker half of prefill/decode disaggregation: the KV pool registered with NIXL, vLLM's handshake side
channel, and the reads a decode instance makes of a prefill instance's blocks.

Speaks vLLM's NixlConnector protocol: a ZeroMQ ROUTER side channel answers msgpack `[b"get_meta_msg", rank]`
with `NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}` (msgpack of `NixlAgentMetadata`);
descriptors are per region (`[layer 0 K, layer 0 V, layer 1 K, ...]`) and block, numbered
`region * num_blocks + block_id`; a read's notification is `b"<remote_request_id>:<tp_size>"`, and the
prefill instance frees that request's blocks when it arrives. Knows block ids, never requests' tokens.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq

from mmserve.config import KVTransferConfig
from mmserve.scheduler.output import KVLoad

logger = logging.getLogger(__name__)

GET_META_MSG = b"get_meta_msg"
NIXL_CONNECTOR_VERSION = 2  # vLLM's: kv_transfer_params carry remote_request_id
KV_CACHE_LAYOUT = "NHD"  # a block is [block_size, num_kv_heads, head_dim]
_HANDSHAKE_TIMEOUT_S = 5.0  # vLLM's side-channel receive timeout
# Without NIXL's own progress thread (a CPU pool): how often ours advances UCX while transfers are pending.
# UCX over TCP serves a READ in software on both ends, so each end must progress for the bytes to move; an
# engine step can last far longer than that.
_PROGRESS_INTERVAL_S = 0.0005
# ... and for how long after the last step that said so: a step that ends the last transfer is often the
# last step an idle engine runs, and a long step in between must not stall a transfer.
_PROGRESS_LINGER_S = 10.0
_NIXL_LOCK = threading.Lock()


class NixlAgentMetadata(msgspec.Struct):
    """vLLM's handshake metadata (a msgpack map with these field names)."""

    engine_id: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    kv_caches_base_addr: list[int]  # one per region: [layer 0 K, layer 0 V, layer 1 K, ...]
    device_id: int
    num_blocks: int
    block_lens: list[int]  # bytes of one block, per region
    kv_cache_layout: str
    block_size: int


class NixlHandshakePayload(msgspec.Struct):
    compatibility_hash: str  # sha256 hex of what must agree for blocks to mean the same on both sides
    agent_metadata_bytes: bytes  # msgpack(NixlAgentMetadata)


def compatibility_hash(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: torch.dtype) -> str:
    """What two instances must share for a block read from one to mean the same in the other (the model's
    KV shape and element type; the block size and layout are compared field by field)."""
    factors = ("mmserve", NIXL_CONNECTOR_VERSION, num_layers, num_kv_heads, head_dim, str(kv_cache_dtype))
    return hashlib.sha256(repr(factors).encode()).hexdigest()


class SideChannel:
    """A thread answering vLLM's handshake on a ZeroMQ ROUTER socket with this instance's payload. The port is
    bound at construction, before the NIXL agent exists (its UCX listeners take ephemeral ports, one of which
    could be the side channel's), and answered from `serve(payload)` on, once the agent's metadata is known."""

    def __init__(self, host: str, port: int) -> None:
        self._payload = b""
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{socket.gethostbyname(host)}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close()
            raise OSError(f"the NIXL side channel cannot listen on {host}:{port} ({exc})") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel", daemon=True)

    def serve(self, payload: bytes) -> None:
        """Answer handshakes with `payload` from now on (requests that came earlier wait in the socket)."""
        self._payload = payload
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            try:
                message, _rank = msgspec.msgpack.decode(frames[-1])
            except (msgspec.DecodeError, TypeError, ValueError):
                logger.warning("NIXL side channel: dropping an undecodable handshake")
                continue
            if message != GET_META_MSG:
                logger.warning("NIXL side channel: unexpected handshake message %r", message)
                continue
            self._socket.send_multipart([frames[0], b"", self._payload])
        self._socket.close()

    def close(self) -> None:
        if self._thread.ident is None:  # never served: the socket is still ours to close
            self._socket.close()
            return
        self._stop.set()
        self._thread.join(timeout=2.0)


def fetch_handshake(host: str, port: int, timeout_s: float) -> bytes:
    """Ask a prefill instance's side channel for its payload (a ZeroMQ REQ, as vLLM's decode side)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0)))
        return sock.recv()
    finally:
        sock.close()


@dataclass
class _Remote:
    agent_name: str
    dlist: object  # the remote descriptors, prepared
    num_blocks: int


@dataclass
class _Read:
    load: KVLoad
    deadline: float  # time.monotonic()
    handle: object = None  # the NIXL transfer, once posted
    posted_at: float = 0.0  # time.perf_counter() when posted


@dataclass(frozen=True)
class KVTransferReport:
    """One step's news: reads into this instance that ended (their request ids), the requests whose blocks
    decode instances have read, and the blocks and wall seconds of the reads done."""

    done: tuple[str, ...]
    failed: tuple[str, ...]
    sent: tuple[str, ...]
    blocks_read: int
    read_s: float


class NixlKVWorker:
    """This instance's KV pool in NIXL: the side channel that describes it, the reads into it, and the
    notifications of reads out of it. `step` is called once per engine step, on the engine's thread."""

    def __init__(
        self, kv_caches: list[torch.Tensor], block_size: int, engine_id: str, config: KVTransferConfig
    ) -> None:
        self.engine_id = engine_id
        self.side_channel_port = config.side_channel_port
        self._side_channel = SideChannel(config.side_channel_host, config.side_channel_port)
        try:
            self._start(kv_caches, block_size, config)
        except BaseException:
            self._side_channel.close()
            raise

    def _start(self, kv_caches: list[torch.Tensor], block_size: int, config: KVTransferConfig) -> None:
        """The agent, its registered pool and the side channel's payload (the port is already bound)."""
        from nixl._api import (  # only an instance that disaggregates needs it
            nixl_agent,
            nixl_agent_config,
            nixl_thread_sync_t,
        )

        engine_id = self.engine_id
        self.block_size = block_size
        self.timeout_s = config.kv_load_timeout
        first = kv_caches[0]  # [2, num_blocks, block_size, num_kv_heads, head_dim] per layer
        self.num_blocks = first.shape[1]
        self.block_len = first[0, 0].numel() * first.element_size()
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = max(first.get_device(), 0)
        regions = [cache[kv] for cache in kv_caches for kv in (0, 1)]  # each [num_blocks, block_size, heads, dim]
        assert all(r.is_contiguous() for r in regions)
        self.base_addrs = [r.data_ptr() for r in regions]
        # Without a progress thread the transfers advance when `step` polls them (each engine step; a core
        # with reads or leases pending keeps stepping), both for this instance's reads and for reads of it.
        nixl_progress_thread = first.is_cuda if config.progress_thread is None else config.progress_thread
        # Our progress thread calls in from a second thread: the lock below serializes the calls, and STRICT
        # makes NIXL guard its own state for that too.
        self.agent = nixl_agent(engine_id, nixl_agent_config(enable_prog_thread=nixl_progress_thread,
                                                             backends=config.backends,
                                                             sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))  # fmt: skip
        # Every call into the agent holds the process's NIXL lock: the engine's thread (`step`) and, without
        # NIXL's own, our progress thread, which runs only while `step` says transfers are pending (else it
        # waits, idle). One lock for all agents of a process (tests run two in one; UCX state is per process).
        self._lock = _NIXL_LOCK
        self._transfers_pending = threading.Event()
        self._closed = False
        self._progress_until = 0.0
        self._notifs: list[bytes] = []  # reads of ours reported while the progress thread polled
        self._progress = None
        if not nixl_progress_thread:
            self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
            self._progress.start()
        self._registered = self.agent.register_memory(
            [(r.data_ptr(), r.numel() * r.element_size(), self.device_id, "") for r in regions], self.mem_type
        )
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._descriptors(self.base_addrs, self.num_blocks,
                                                 self.block_len), self.mem_type)  # fmt: skip
        self.compat = compatibility_hash(len(kv_caches), first.shape[3], first.shape[4], first.dtype)
        metadata = NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=self.agent.get_agent_metadata(),
            kv_caches_base_addr=self.base_addrs,
            device_id=self.device_id,
            num_blocks=self.num_blocks,
            block_lens=[self.block_len] * len(regions),
            kv_cache_layout=KV_CACHE_LAYOUT,
            block_size=block_size,
        )
        payload = NixlHandshakePayload(self.compat, msgspec.msgpack.encode(metadata))
        self._side_channel.serve(msgspec.msgpack.encode(payload))
        self._handshaker = ThreadPoolExecutor(1, thread_name_prefix="nixl-handshake")
        self._remotes: dict[str, _Remote] = {}  # engine id -> its agent, once the handshake is done
        self._handshakes: dict[str, Future[bytes]] = {}
        self._reads: dict[str, _Read] = {}  # request id -> its read (waiting for a handshake, or posted)

    def _descriptors(self, base_addrs: list[int], num_blocks: int, block_len: int) -> np.ndarray:
        """[regions x num_blocks, 3] (address, length, device): descriptor `region * num_blocks + block`."""
        offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_len)
        addrs = (np.array(base_addrs, dtype=np.uint64)[:, None] + offsets[None, :]).reshape(-1)
        return np.stack([addrs, np.full_like(addrs, block_len), np.full_like(addrs, self.device_id)], axis=1)

    # -- one engine step -------------------------------------------------------------------------------
    def step(self, loads: tuple[KVLoad, ...], transfers_pending: bool = True) -> KVTransferReport:
        """Start `loads`, advance the reads in flight, collect the notifications of reads out of this pool.
        `transfers_pending`: whether reads into or out of this pool may be under way (the scheduler's loads,
        leases and orphans): our progress thread advances them between steps until a step says none are."""
        with self._lock:
            report = self._step(loads)
            if transfers_pending or self._reads:
                self._progress_until = time.monotonic() + _PROGRESS_LINGER_S
                self._transfers_pending.set()
            else:
                self._transfers_pending.clear()
        return report

    def _progress_loop(self) -> None:
        while self._transfers_pending.wait():
            with self._lock:
                if self._closed:
                    return
                if not self._reads and time.monotonic() > self._progress_until:
                    self._transfers_pending.clear()  # the engine stopped stepping: nothing is under way
                    continue
                for messages in self.agent.get_new_notifs().values():  # progresses the UCX worker
                    self._notifs.extend(messages)
            time.sleep(_PROGRESS_INTERVAL_S)

    def _step(self, loads: tuple[KVLoad, ...]) -> KVTransferReport:
        now = time.monotonic()
        for load in loads:
            self._reads[load.request_id] = _Read(load, now + self.timeout_s)
            if load.remote_engine_id not in self._remotes and load.remote_engine_id not in self._handshakes:
                self._handshakes[load.remote_engine_id] = self._handshaker.submit(
                    fetch_handshake, load.remote_host, load.remote_port, min(_HANDSHAKE_TIMEOUT_S, self.timeout_s)
                )
        done: list[str] = []
        failed: list[str] = []
        blocks_read, read_s = 0, 0.0
        broken = self._finish_handshakes()
        for request_id, read in list(self._reads.items()):
            ok = self._advance(read, broken, now)
            if ok is None:
                continue
            del self._reads[request_id]
            if ok:
                done.append(request_id)
                blocks_read += len(read.load.local_block_ids)
                read_s += time.perf_counter() - read.posted_at if read.posted_at else 0.0
            else:
                failed.append(request_id)
                self._forget_remote(read.load.remote_engine_id)  # it may have restarted: handshake again
        return KVTransferReport(tuple(done), tuple(failed), self._reads_of_ours(), blocks_read, read_s)

    def _advance(self, read: _Read, broken: dict[str, str], now: float) -> bool | None:
        """One read's progress: True done, False failed, None still going."""
        load = read.load
        if read.handle is None:
            if load.remote_engine_id in broken:
                logger.error("KV read for %s: handshake with %s:%d failed: %s", load.request_id, load.remote_host,
                             load.remote_port, broken[load.remote_engine_id])  # fmt: skip
                return False
            remote = self._remotes.get(load.remote_engine_id)
            if remote is None:
                return None if now < read.deadline else self._timed_out(read)
            return self._post(read, remote)
        try:
            state = self.agent.check_xfer_state(read.handle)
        except Exception as exc:  # nixl raises on a transfer whose peer is gone
            logger.error("KV read for %s failed: %s", load.request_id, exc)
            state = "ERR"
        if state == "PROC" and now < read.deadline:
            return None
        if state == "PROC":
            return self._timed_out(read)
        self._release(read)
        if state != "DONE":
            logger.error("KV read for %s from engine %s failed (%s)", load.request_id, load.remote_engine_id, state)
        return state == "DONE"

    def _post(self, read: _Read, remote: _Remote) -> bool | None:
        load = read.load
        if load.remote_tp_size != 1 or any(b >= remote.num_blocks for b in load.remote_block_ids) or any(
            b >= self.num_blocks for b in load.local_block_ids
        ):
            logger.error("KV read for %s: block ids or tp_size %d do not fit", load.request_id, load.remote_tp_size)
            return False
        notif = f"{load.remote_request_id}:1".encode()
        if not load.local_block_ids:  # nothing to read: only let the prefill instance free its blocks
            self.agent.send_notif(remote.agent_name, notif_msg=notif)
            return True
        num_regions = len(self.base_addrs)
        local = [r * self.num_blocks + b for r in range(num_regions) for b in load.local_block_ids]
        far = [r * remote.num_blocks + b for r in range(num_regions) for b in load.remote_block_ids]
        try:
            read.posted_at = time.perf_counter()
            read.handle = self.agent.make_prepped_xfer("READ", self._local, local, remote.dlist, far, notif_msg=notif)
            state = self.agent.transfer(read.handle)
        except Exception as exc:
            logger.error("KV read for %s could not start: %s", load.request_id, exc)
            self._release(read)
            return False
        if state == "ERR":
            self._release(read)
            return False
        return None

    def _timed_out(self, read: _Read) -> bool:
        logger.error("KV read for %s from %s:%d timed out after %.1f s", read.load.request_id, read.load.remote_host,
                     read.load.remote_port, self.timeout_s)  # fmt: skip
        self._release(read)
        return False

    def _release(self, read: _Read) -> None:
        if read.handle is not None:
            try:
                self.agent.release_xfer_handle(read.handle)
            except Exception as exc:  # a transfer still in progress may refuse; nixl frees it with the agent
                logger.warning("releasing a KV read's handle: %s", exc)
            read.handle = None

    def _finish_handshakes(self) -> dict[str, str]:
        """Add the remote agents whose handshake answered; the engine ids whose handshake failed, and why."""
        broken: dict[str, str] = {}
        for engine_id, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            try:
                self._remotes[engine_id] = self._add_remote(engine_id, future.result())
            except Exception as exc:  # unreachable, timed out, or refused (a layout that differs)
                broken[engine_id] = str(exc) or type(exc).__name__
        return broken

    def _add_remote(self, engine_id: str, answer: bytes) -> _Remote:
        payload = msgspec.msgpack.decode(answer, type=NixlHandshakePayload)
        if payload.compatibility_hash != self.compat:
            raise ValueError("the prefill instance's model or KV cache dtype differs (compatibility hash)")
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        if meta.engine_id != engine_id:
            raise ValueError(f"the side channel answered for engine {meta.engine_id!r}, not {engine_id!r}")
        if meta.block_size != self.block_size or meta.kv_cache_layout != KV_CACHE_LAYOUT:
            raise ValueError(
                f"block size {meta.block_size} / layout {meta.kv_cache_layout} there, {self.block_size} / "
                f"{KV_CACHE_LAYOUT} here"
            )
        if len(meta.kv_caches_base_addr) != len(self.base_addrs) or set(meta.block_lens) != {self.block_len}:
            raise ValueError("the KV pools' regions or block lengths differ")
        name = self.agent.add_remote_agent(meta.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        dlist = self.agent.prep_xfer_dlist(name, self._descriptors(meta.kv_caches_base_addr, meta.num_blocks,
                                           self.block_len), self.mem_type)  # fmt: skip
        return _Remote(name, dlist, meta.num_blocks)

    def _forget_remote(self, engine_id: str) -> None:
        remote = self._remotes.pop(engine_id, None)
        if remote is None or any(r.load.remote_engine_id == engine_id for r in self._reads.values()):
            if remote is not None:
                self._remotes[engine_id] = remote  # other reads still use it
            return
        try:
            self.agent.release_dlist_handle(remote.dlist)
            self.agent.remove_remote_agent(remote.agent_name)
        except Exception as exc:
            logger.warning("forgetting remote engine %s: %s", engine_id, exc)

    def _reads_of_ours(self) -> tuple[str, ...]:
        """Request ids whose blocks decode instances have read (`<request id>:<tp size>` notifications)."""
        messages, self._notifs = self._notifs, []
        for new in self.agent.get_new_notifs().values():
            messages.extend(new)
        return tuple(message.decode(errors="replace").rpartition(":")[0] for message in messages)

    def num_reads(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._transfers_pending.set()  # wakes the progress thread to end
        if self._progress is not None:
            self._progress.join(timeout=5)
        self._side_channel.close()
        self._handshaker.shutdown(wait=False, cancel_futures=True)
        for read in self._reads.values():
            self._release(read)
        self._reads.clear()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:
            logger.warning("deregistering the KV pool from NIXL: %s", exc)
