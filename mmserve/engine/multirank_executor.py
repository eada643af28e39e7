"""Tensor parallelism behind the `Executor` interface: the engine core's process is the first rank (it
holds the scheduler, runs its shard and samples); ranks 1..N-1 are processes of their own
(`rank_worker`), started here, that join one torch.distributed group (gloo on the CPU, NCCL on CUDA).

Each step's incremental plan is encoded once and its frames are pushed to every rank over ZeroMQ (with
each rank's own media pixels, data mode), then every rank executes it in lockstep; the collectives
inside the model are the only synchronisation. Control calls (encoder-cache reset, fault injection)
travel on the same channel, so every rank sees them at the same point between plans. One PUSH socket
per rank rather than one PUB: nothing is lost to a late subscriber, and a rank gets only its pixels.

Faults: a step that fails alike on every rank (`StepFault.ranks_agree`) fails its requests as with one
rank. Anything else (a rank that exits or disconnects, a collective that fails or times out, an error
that may have left the ranks at different collectives) raises `EngineFatalError`: the engine cannot go
on, and `close()` leaves no rank running. A monitor thread watches the ranks (their processes, their
plan connections: ZeroMQ heartbeats over TCP) also while a step runs, and aborts the NCCL group when
one is gone, so a collective waiting on a dead rank fails instead of waiting out the timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import zmq
from torch import nn
from zmq.utils.monitor import recv_monitor_message

from mmserve.distributed.group import TensorParallelGroup
from mmserve.engine.faults import EngineFatalError, StepFault
from mmserve.engine.ipc import socket_directory
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.rank_plan import (
    InjectFaults,
    PlanEncoder,
    RankFailed,
    RankHeldState,
    RankOutput,
    RankReady,
    ReportHeldState,
    ResetEncoderCache,
    StopRank,
)
from mmserve.engine.rank_worker import (
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    REPLY_KEY,
    RUNNER_KEY,
    RankSpec,
    RunnerSpec,
    checkpoint_fingerprint,
    joining_key,
    plan_key,
)
from mmserve.engine.sampler import GrammarBitmask
from mmserve.engine.serial import Decoder
from mmserve.kernels.fp8 import KV_CACHE_DTYPES
from mmserve.models.config import DecoderConfig
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # every rank (remote ones included) must have joined and loaded within this
_STOP_TIMEOUT_S = 10.0
_REPLY_TIMEOUT_S = 10.0
_MONITOR_EVERY_S = 0.25
_LOOPBACK = ("127.0.0.1", "localhost")


class MultiRankExecutor:
    def __init__(
        self,
        model_dir: str,
        cfg: DecoderConfig,
        hf_config: Any,
        device: torch.device,
        dtype_name: str,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        world_size: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        num_local_ranks: int | None = None,
        mm_encoder_tp_mode: str = "data",
        kv_cache_dtype: str = "auto",  # a name of kernels/fp8.py's KV_CACHE_DTYPES
        calculate_kv_scales: bool = False,
        quant_compute: str | None = None,
    ) -> None:
        """Starts ranks 1..num_local_ranks-1 here (all of them by default); the others (another
        node) join by themselves through the store at `host:port` (`rank_worker`'s torchrun mode);
        `host` must then be this node's address as the other nodes reach it."""
        if world_size < 2:
            raise ValueError("MultiRankExecutor needs at least 2 ranks")
        self.world_size = world_size
        self._timeout_s = timeout_s
        self._num_local = num_local_ranks or world_size
        self._remote = self._num_local < world_size
        self._procs: list[subprocess.Popen] = []
        self._context = zmq.Context()
        self._dead: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # the plan sockets: sends (core thread) and close
        self._replies: list[Any] = []  # replies read from the ranks and not consumed yet
        self._previous_threads = torch.get_num_threads()
        self._plan_encoder = PlanEncoder(world_size, shard_encoder=mm_encoder_tp_mode == "weights")
        self._decoder = Decoder(RankOutput)
        self._plans: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
        self._store: Any = None
        self._monitor_thread: threading.Thread | None = None
        num_threads = None
        if device.type == "cpu":  # the cores are shared among the local ranks
            num_threads = max(1, (os.cpu_count() or 1) // self._num_local)
            torch.set_num_threads(num_threads)
        self._dir = socket_directory("mmserve-tp-")
        # Ranks still running when this object is collected or the interpreter exits are killed.
        self._finalizer = weakref.finalize(self, _kill, self._procs)
        try:
            self._store = self._host_store(host, port)
            self._reply = self._context.socket(zmq.PULL)
            self._reply.setsockopt(zmq.LINGER, 0)
            self._store.set(REPLY_KEY, self._bind(self._reply, host, "reply"))
            for rank in range(1, world_size):
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)  # plans are never dropped (a send with no peer fails)
                sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # a silent peer (TCP) is disconnected
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                self._monitors.append(sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED))
                self._store.set(plan_key(rank), self._bind(sock, host, f"plan-{rank}"))
                self._plans.append(sock)
            self._peers = [0] * (world_size - 1)  # connections accepted minus lost, per plan socket
            first_index = 0
            if device.type == "cuda":
                first_index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.set_device(first_index)
                if first_index + self._num_local > torch.cuda.device_count():
                    raise ValueError(
                        f"{self._num_local} local ranks from cuda:{first_index} need more than the "
                        f"{torch.cuda.device_count()} CUDA devices here"
                    )
            env = {k: v for k, v in os.environ.items() if k.startswith("MMSERVE_")}  # e.g. the attention backend
            runner_spec = RunnerSpec(
                model_dir, device.type, first_index, dtype_name, num_blocks, block_size, timeout_s, num_threads,
                mm_encoder_tp_mode, env, kv_cache_dtype, calculate_kv_scales, quant_compute,
            )  # fmt: skip
            self._store.set(RUNNER_KEY, runner_spec.to_json())
            for rank in range(1, self._num_local):
                self._spawn(RankSpec(rank, world_size, rank, host, self._store.port, os.getpid()))
            self._await_joining()
            self.tp = TensorParallelGroup.join(self._store, 0, world_size, device, timeout_s)
            self._runner = ModelRunner(
                model_dir, cfg, device, dtype, num_blocks, block_size, hf_config, self.tp, mm_encoder_tp_mode,
                KV_CACHE_DTYPES[kv_cache_dtype], calculate_kv_scales, quant_compute,
            )  # fmt: skip
            self._await_ready(checkpoint_fingerprint(model_dir))
        except BaseException:
            self.close()
            raise
        self._monitor_thread = threading.Thread(target=self._monitor, name="mmserve-tp-monitor", daemon=True)
        self._monitor_thread.start()

    # -- start-up --------------------------------------------------------------------------------------
    def _host_store(self, host: str, port: int) -> Any:
        if self._remote or host not in _LOOPBACK:
            return TensorParallelGroup.rendezvous(host, port, self.world_size, True)
        # Every rank is local: the store listens on loopback only (not on every interface).
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen()
        try:
            return TensorParallelGroup.rendezvous(host, listener.getsockname()[1], self.world_size, True,
                                                  listen_fd=listener.fileno())  # fmt: skip
        finally:
            listener.detach()  # the store owns the descriptor now

    def _bind(self, sock: zmq.Socket, host: str, name: str) -> str:
        """Bind `sock`; returns the address the ranks connect to."""
        if not self._remote and host in _LOOPBACK:
            sock.bind(f"ipc://{Path(self._dir) / name}")  # a private directory: only this user's processes
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        port = sock.bind_to_random_port("tcp://*")
        return f"tcp://{host}:{port}"

    def _spawn(self, spec: RankSpec) -> None:
        command = [sys.executable, "-m", "mmserve.engine.rank_worker", "--spec", json.dumps(asdict(spec))]
        # Its own process group: a signal to the server's group reaches the core, which stops the ranks.
        self._procs.append(subprocess.Popen(command, start_new_session=True))

    def _await_joining(self) -> None:
        """Wait until every rank is about to join the group (the join itself waits for no failure)."""
        keys = [joining_key(rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._store.check(keys):
            self._raise_if_start_failed()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self._store.check([k])]
                raise EngineFatalError(f"tensor-parallel ranks did not join in time: {missing}")
            self._reply.poll(100)

    def _await_ready(self, fingerprint: str) -> None:
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while waiting:
            if time.monotonic() > deadline:
                raise EngineFatalError(f"tensor-parallel ranks {sorted(waiting)} were not ready in time")
            self._raise_if_start_failed()
            for message in [m for m in self._replies if isinstance(m, RankReady)]:
                self._replies.remove(message)
                if message.fingerprint != fingerprint:
                    raise EngineFatalError(
                        f"tensor-parallel rank {message.rank} loaded a different checkpoint (config.json or "
                        "*.safetensors differ from the first rank's)"
                    )
                waiting.discard(message.rank)
            if waiting:
                self._reply.poll(100)

    def _raise_if_start_failed(self) -> None:
        self._read_replies()
        if self._dead is None:
            self._dead = self._exited_rank()
        if self._dead is not None:
            raise EngineFatalError(f"the tensor-parallel ranks failed to start: {self._dead}")

    # -- Executor --------------------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        self.check_health()
        shared, per_rank = self._plan_encoder.encode(plan)
        with self._lock:
            for rank, sock in enumerate(self._plans, start=1):
                pixels = per_rank[rank]
                if pixels is not None:
                    self._send(sock, rank, pixels)
                self._send(sock, rank, shared)
        try:
            return self._runner.execute(plan, grammar)  # only rank 0 samples: the others never need it
        except StepFault as fault:
            if fault.ranks_agree:
                raise
            cause = fault.__cause__
            self._dead = self._dead or self._exited_rank() or (
                f"a tensor-parallel step failed where the ranks may have left lockstep (a rank died, or hung past "
                f"distributed_timeout_s={self._timeout_s:g}): {type(cause).__name__}: {cause}"
            )
            raise EngineFatalError(self._dead) from fault

    def reset_encoder_cache(self) -> None:
        self._runner.reset_encoder_cache()
        self._send_control(ResetEncoderCache())

    def inject_faults(self, action: str, request_ids: tuple[str, ...] = ()) -> None:
        self._runner.faults.apply(action, request_ids)
        self._send_control(InjectFaults(action, list(request_ids)))

    def attention_backend(self) -> str:
        return self._runner.backend.name

    def decode_graphs(self) -> tuple[str, tuple[int, ...], dict[int, int]]:
        return self._runner.decode_graph_summary()

    def weight_bytes(self) -> int:
        return self._runner.weight_bytes()

    def decode_stack_blocker(self) -> str | None:
        return self._runner.decode_stack_blocker

    def local_model(self) -> nn.Module | None:
        return None  # this process holds only the first rank's shard

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        """Over every rank: the most requests any keeps state for, and the union of encoder keys."""
        num_requests, keys = self._runner.held_state()
        union = set(keys)
        self._send_control(ReportHeldState())
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while waiting:
            self.check_health()  # also moves every reply that has arrived into _replies
            for message in [m for m in self._replies if isinstance(m, RankHeldState)]:
                self._replies.remove(message)
                waiting.discard(message.rank)
                num_requests = max(num_requests, message.num_requests)
                union.update((h, g) for h, g in message.encoder_keys)
            if waiting and time.monotonic() > deadline:  # a rank that stops answering cannot be trusted
                self._dead = f"tensor-parallel ranks {sorted(waiting)} did not report their state"
                raise EngineFatalError(self._dead)
            if waiting:
                self._reply.poll(100)
        return num_requests, sorted(union)

    def check_health(self) -> None:
        if self._closed:
            raise EngineFatalError("the executor is closed")
        self._read_replies()
        if self._dead is not None:
            raise EngineFatalError(self._dead)

    def close(self) -> None:
        """Stop every rank: each is asked (one that is idle stops at once), then a local one still
        running is killed (at once when the engine is dead: it may be stuck in a collective)."""
        if self._closed:
            return
        self._closed = True
        if self._monitor_thread is not None:
            self._monitor_thread.join()
        dead = self._dead is not None
        with self._lock:
            frames = self._plan_encoder.encode_control(StopRank())
            for sock in self._plans:
                with contextlib.suppress(zmq.ZMQError):  # no peer: nobody to tell
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                sock.setsockopt(zmq.LINGER, 1000)  # remote ranks still get it
        deadline = time.monotonic() + (0.0 if dead else _STOP_TIMEOUT_S)
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not dead:
                    logger.warning("tensor-parallel rank (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if hasattr(self, "tp"):
            self.tp.close(abort=dead)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._context.destroy()
        self._store = None  # releases a fixed master_port
        torch.set_num_threads(self._previous_threads)
        self._finalizer.detach()
        with contextlib.suppress(OSError):
            for entry in Path(self._dir).iterdir():
                entry.unlink()
            Path(self._dir).rmdir()

    # -- helpers ---------------------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, rank: int, frames: list[Any]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # an unlimited queue refuses only when no rank is connected
            self._dead = self._dead or f"tensor-parallel rank {rank} is not connected"
            raise EngineFatalError(self._dead) from None

    def _send_control(self, message: Any) -> None:
        self.check_health()
        frames = self._plan_encoder.encode_control(message)
        with self._lock:
            for rank, sock in enumerate(self._plans, start=1):
                self._send(sock, rank, frames)

    def _read_replies(self) -> None:
        """Move every reply that has arrived into `_replies`; a `RankFailed` makes the engine dead."""
        with contextlib.suppress(zmq.Again):
            while True:  # a rank that fails says so before it exits
                message = self._decoder.decode(self._reply.recv_multipart(zmq.NOBLOCK, copy=False))
                if isinstance(message, RankFailed):
                    self._dead = self._dead or f"tensor-parallel rank {message.rank} failed: {message.message}"
                else:
                    self._replies.append(message)

    def _exited_rank(self) -> str | None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}"
        return None

    def _lost_connection(self) -> str | None:
        """Reads the plan sockets' monitors: a rank that disconnected (its process died, or its TCP
        heartbeats stopped), or a second process connected as the same rank."""
        for index, monitor in enumerate(self._monitors):
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                self._peers[index] += 1 if event == zmq.EVENT_ACCEPTED else -1
                rank = index + 1
                if self._peers[index] > 1:
                    return f"two processes connected as tensor-parallel rank {rank}"
                if event == zmq.EVENT_DISCONNECTED:
                    return f"tensor-parallel rank {rank} disconnected"
        return None

    def _monitor(self) -> None:
        """Until closed: record a rank that is gone and, on CUDA, abort the group (a collective waiting
        on it fails now instead of after the timeout; gloo fails at once by itself)."""
        while not self._closed:
            if self._dead is None:
                reason = self._exited_rank() or self._lost_connection()
                if reason is not None:
                    logger.error("%s: the engine cannot go on", reason)
                    self._dead = reason
                    self.tp.abort_device_group()
            time.sleep(_MONITOR_EVERY_S)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
