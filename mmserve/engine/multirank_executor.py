"""Tensor parallelism behind the `Executor` interface: the engine core's process is the first rank (it
holds the scheduler, runs its shard and samples); ranks 1..N-1 are processes of their own
(`rank_worker`), started here, that join one torch.distributed group (gloo on the CPU, NCCL on CUDA).

Each step's incremental plan is encoded once and its frames are pushed to every rank over ZeroMQ (with
each rank's own media pixels, data mode), then every rank executes it in lockstep; the collectives
inside the model are the only synchronisation. Control calls (encoder-cache reset, fault injection)
travel on the same channel, so every rank sees them at the same point between plans.

Faults: a step that fails alike on every rank (`StepFault.ranks_agree`) fails its requests as with one
rank. Anything else (a rank that exits, a collective that fails or times out, an error that may have
left the ranks at different collectives) raises `EngineFatalError`: the engine cannot go on, and
`close()` leaves no rank running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import zmq

from mmserve.distributed.group import TensorParallelGroup
from mmserve.engine.faults import EngineFatalError, StepFault
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
from mmserve.engine.rank_worker import REPLY_KEY, RUNNER_KEY, RankSpec, RunnerSpec, plan_key
from mmserve.engine.serial import Decoder
from mmserve.models.config import DecoderConfig
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # every rank must have loaded its shard within this
_STOP_TIMEOUT_S = 10.0
_REPLY_TIMEOUT_S = 10.0


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
    ) -> None:
        """Starts ranks 1..num_local_ranks-1 here (all of them by default); the others (another
        node) join by themselves through the store at `host:port` (`rank_worker`'s torchrun mode)."""
        if world_size < 2:
            raise ValueError("MultiRankExecutor needs at least 2 ranks")
        self.world_size = world_size
        self._timeout_s = timeout_s
        self._procs: list[subprocess.Popen] = []
        self._context = zmq.Context()
        self._dead: str | None = None
        self._closed = False
        self._replies: list[Any] = []  # replies read from the ranks and not consumed yet
        self._previous_threads = torch.get_num_threads()
        num_threads = None
        if device.type == "cpu":  # the cores are shared among the local ranks
            num_threads = max(1, (os.cpu_count() or 1) // (num_local_ranks or world_size))
            torch.set_num_threads(num_threads)
        self._dir = tempfile.mkdtemp(prefix="mmserve-tp-")
        try:
            self._store = TensorParallelGroup.rendezvous(host, port, world_size, True)
            self._reply = self._context.socket(zmq.PULL)
            self._reply.setsockopt(zmq.LINGER, 0)
            self._reply.bind(self._address(host, "reply"))
            self._store.set(REPLY_KEY, self._reply.getsockopt(zmq.LAST_ENDPOINT).decode())
            self._plans: list[zmq.Socket] = []
            for rank in range(1, world_size):
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)  # plans are never dropped; a rank that stops reading fails a collective
                sock.bind(self._address(host, f"plan-{rank}"))
                self._store.set(plan_key(rank), sock.getsockopt(zmq.LAST_ENDPOINT).decode())
                self._plans.append(sock)
            runner_spec = RunnerSpec(
                model_dir, device.type, dtype_name, num_blocks, block_size, timeout_s, num_threads, mm_encoder_tp_mode
            )
            self._store.set(RUNNER_KEY, runner_spec.to_json())
            for rank in range(1, num_local_ranks or world_size):
                self._spawn(RankSpec(rank, world_size, rank, host, self._store.port, os.getpid()))
            self._decoder = Decoder(RankOutput)
            self.tp = TensorParallelGroup.join(self._store, 0, world_size, device, timeout_s)
            self._runner = ModelRunner(
                model_dir, cfg, device, dtype, num_blocks, block_size, hf_config, self.tp, mm_encoder_tp_mode
            )
            self._await_ready()
        except BaseException:
            self.close()
            raise
        self._plan_encoder = PlanEncoder(world_size, shard_encoder=mm_encoder_tp_mode == "weights")

    def _address(self, host: str, name: str) -> str:
        if host in ("127.0.0.1", "localhost"):
            return f"ipc://{Path(self._dir) / name}"
        return f"tcp://{host}:*"

    def _spawn(self, spec: RankSpec) -> None:
        command = [sys.executable, "-m", "mmserve.engine.rank_worker", "--spec", json.dumps(asdict(spec))]
        # Its own process group: a signal to the server's group reaches the core, which stops the ranks.
        self._procs.append(subprocess.Popen(command, start_new_session=True))

    def _await_ready(self) -> None:
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while waiting:
            if time.monotonic() > deadline:
                raise EngineFatalError(f"tensor-parallel ranks {sorted(waiting)} were not ready in time")
            self._check_processes()
            if not self._reply.poll(200):
                continue
            message = self._decoder.decode(self._reply.recv_multipart(copy=False))
            if isinstance(message, RankFailed):
                raise EngineFatalError(f"tensor-parallel rank {message.rank} failed to start: {message.message}")
            if isinstance(message, RankReady):
                waiting.discard(message.rank)

    # -- Executor --------------------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        shared, per_rank = self._plan_encoder.encode(plan)
        for rank, sock in enumerate(self._plans, start=1):
            pixels = per_rank[rank]
            if pixels is not None:
                sock.send_multipart(pixels, copy=False)
            sock.send_multipart(shared, copy=False)
        try:
            return self._runner.execute(plan)
        except StepFault as fault:
            if fault.ranks_agree:
                raise
            self._check_processes_quietly()
            cause = fault.__cause__
            self._dead = self._dead or (
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

    def weight_bytes(self) -> int:
        return self._runner.weight_bytes()

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
            if waiting and time.monotonic() > deadline:
                raise EngineFatalError(f"tensor-parallel ranks {sorted(waiting)} did not report their state")
            if waiting:
                self._reply.poll(100)
        return num_requests, sorted(union)

    def check_health(self) -> None:
        if self._closed:
            raise EngineFatalError("the executor is closed")
        if self._dead is None:
            with contextlib.suppress(zmq.Again):
                while True:  # a rank that fails says so before it exits
                    message = self._decoder.decode(self._reply.recv_multipart(zmq.NOBLOCK, copy=False))
                    if isinstance(message, RankFailed):
                        self._dead = f"tensor-parallel rank {message.rank} failed: {message.message}"
                    else:
                        self._replies.append(message)
            self._check_processes_quietly()
        if self._dead is not None:
            raise EngineFatalError(self._dead)

    def close(self) -> None:
        """Stop every rank this executor started (asked, then killed past a timeout) and release the group."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None and hasattr(self, "_plan_encoder"):
            with contextlib.suppress(Exception):
                self._send_control(StopRank())
            deadline = time.monotonic() + _STOP_TIMEOUT_S
        else:  # a dead engine: the ranks may be stuck in a collective (or stopped); nothing is asked
            deadline = time.monotonic()
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if self._dead is None:
                    logger.warning("tensor-parallel rank (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if hasattr(self, "tp"):
            self.tp.close()
        self._context.destroy(linger=0)
        torch.set_num_threads(self._previous_threads)
        with contextlib.suppress(OSError):
            for entry in Path(self._dir).iterdir():
                entry.unlink()
            Path(self._dir).rmdir()

    def rank_pids(self) -> list[int]:
        """Process ids of the ranks this executor started (tests: a killed rank)."""
        return [p.pid for p in self._procs]

    # -- helpers ---------------------------------------------------------------------------------------
    def _send_control(self, message: Any) -> None:
        frames = self._plan_encoder.encode_control(message)
        for sock in self._plans:
            sock.send_multipart(frames, copy=False)

    def _check_processes_quietly(self) -> None:
        """Record (not raise) a rank that has exited, as the reason the engine is dead."""
        try:
            self._check_processes()
        except EngineFatalError as exc:
            self._dead = self._dead or str(exc)

    def _check_processes(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise EngineFatalError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}")
