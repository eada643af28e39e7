"""A tensor-parallel rank other than the first: a process that joins the group, builds its shard's
model runner and executes every plan the first rank sends, in order, until told to stop or its parent
dies. An error it cannot attribute to the step alike on every rank ends the process (exit status 1);
the first rank's next collective then fails at once.

Started by the first rank (`MultiRankExecutor`: `python -m mmserve.engine.rank_worker --spec JSON`) or,
on another node, by hand or any launcher with torchrun's variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT` (the first rank's rendezvous store), e.g.
`RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 python -m mmserve.engine.rank_worker`.
Everything else (checkpoint, dtype, KV pool, where plans come from) it reads from the store.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import zmq

from mmserve.distributed.group import TensorParallelGroup
from mmserve.engine.faults import StepFault
from mmserve.engine.rank_plan import (
    InjectFaults,
    PlanDecoder,
    RankFailed,
    RankHeldState,
    RankReady,
    ReportHeldState,
    ResetEncoderCache,
    StopRank,
)
from mmserve.engine.serial import Encoder
from mmserve.gc_heap import startup_heap_frozen
from mmserve.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from mmserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_POLL_MS = 500  # how often an idle rank checks that its parent lives


@dataclass(frozen=True)
class RankSpec:
    """Where a rank finds the group; the rest (`RunnerSpec`) it reads from the store."""

    rank: int
    world_size: int
    local_rank: int
    store_host: str
    store_port: int
    parent_pid: int | None = None  # a rank started by the first rank exits when it is gone
    model_dir: str | None = None  # the checkpoint's path on this node; None: the first rank's path


@dataclass(frozen=True)
class RunnerSpec:
    """What every rank builds its runner from: published by the first rank in the store."""

    model_dir: str
    device_type: str  # "cpu" | "cuda"
    first_device_index: int  # CUDA: rank 0's device; the local rank r uses first_device_index + r
    dtype: str
    num_blocks: int
    block_size: int
    timeout_s: float
    num_threads: int | None  # torch threads per rank on the CPU; None: torch's default
    mm_encoder_tp_mode: str = "data"
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the first rank's MMSERVE_* variables
    kv_cache_dtype: str = "auto"  # a name of kernels/fp8.py's KV_CACHE_DTYPES
    calculate_kv_scales: bool = False
    quant_compute: str | None = None  # EngineArgs.quant_compute

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RunnerSpec:
        return cls(**json.loads(raw))


RUNNER_KEY = "mmserve/runner"
REPLY_KEY = "mmserve/reply"
# ZeroMQ heartbeats on the plan connection (TCP): a peer silent this long is disconnected, and the
# other side treats it as gone (a rank on another node that died, or whose node did).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000


def plan_key(rank: int) -> str:
    return f"mmserve/plan/{rank}"


def joining_key(rank: int) -> str:
    return f"mmserve/joining/{rank}"


def checkpoint_fingerprint(model_dir: str) -> str:
    """What every rank must agree on: config.json's bytes and the weight files' names and sizes."""
    root = Path(model_dir)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()


def run_rank(spec: RankSpec) -> int:
    """The rank's whole life; returns its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the server, which stops us
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank-{spec.rank}: %(message)s")
    context = zmq.Context()
    reply = None
    tp = None
    try:
        store = TensorParallelGroup.rendezvous(spec.store_host, spec.store_port, spec.world_size, False)
        runner_spec = RunnerSpec.from_json(store.get(RUNNER_KEY))
        if spec.model_dir is not None:
            runner_spec = dataclasses.replace(runner_spec, model_dir=spec.model_dir)
        reply = context.socket(zmq.PUSH)
        reply.setsockopt(zmq.LINGER, 2000)
        reply.connect(store.get(REPLY_KEY).decode())
        plans = context.socket(zmq.PULL)
        plans.setsockopt(zmq.LINGER, 0)
        plans.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        plans.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        plans.connect(store.get(plan_key(spec.rank)).decode())
        os.environ.update(runner_spec.env)  # before the runner picks its kernels and fault hooks
        if runner_spec.num_threads is not None and spec.parent_pid is not None:  # another node: its own cores
            torch.set_num_threads(runner_spec.num_threads)
        device = torch.device(runner_spec.device_type)
        if device.type == "cuda":  # NCCL and every kernel of this rank on its own device
            base = runner_spec.first_device_index if spec.parent_pid is not None else 0  # another node: from 0
            device = torch.device("cuda", base + spec.local_rank)
            torch.cuda.set_device(device)
        store.set(joining_key(spec.rank), str(os.getpid()))
        tp = TensorParallelGroup.join(store, spec.rank, spec.world_size, device, runner_spec.timeout_s)
        runner = _build_runner(runner_spec, device, tp)
        encoder = Encoder()
        fingerprint = checkpoint_fingerprint(runner_spec.model_dir)
        reply.send_multipart(encoder.encode(RankReady(spec.rank, os.getpid(), fingerprint)))
        with startup_heap_frozen(f"rank {spec.rank}"):
            _serve(runner, plans, monitor, reply, encoder, spec)
        return 0
    except BaseException as exc:  # anything: the first rank must hear why, then this rank ends
        logger.exception("rank %d failed", spec.rank)
        if reply is not None:
            with contextlib.suppress(Exception):
                reply.send_multipart(Encoder().encode(RankFailed(spec.rank, f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        if tp is not None:
            tp.close()
        context.destroy(linger=2000)


def _build_runner(spec: RunnerSpec, device: torch.device, tp: TensorParallelGroup) -> ModelRunner:
    from mmserve.engine.core import DTYPES
    from mmserve.engine.model_runner import ModelRunner
    from mmserve.kernels.fp8 import KV_CACHE_DTYPES
    from mmserve.models.config import DecoderConfig

    model_config, hf_config = DecoderConfig.from_pretrained(spec.model_dir)
    dtype = DTYPES[spec.dtype]
    return ModelRunner(
        spec.model_dir,
        model_config,
        device,
        dtype,
        spec.num_blocks,
        spec.block_size,
        hf_config,
        tp,
        spec.mm_encoder_tp_mode,
        KV_CACHE_DTYPES[spec.kv_cache_dtype],
        spec.calculate_kv_scales,
        spec.quant_compute,
    )


def _serve(
    runner: ModelRunner, plans: zmq.Socket, monitor: zmq.Socket, reply: zmq.Socket, encoder: Encoder, spec: RankSpec
) -> None:
    decoder = PlanDecoder()
    poller = zmq.Poller()
    poller.register(plans, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        events = dict(poller.poll(_POLL_MS))
        if monitor in events or (spec.parent_pid is not None and os.getppid() != spec.parent_pid):
            # Its process died (the connection closed), or its heartbeats stopped (another node).
            raise RuntimeError("the first rank is gone")
        if plans not in events:
            continue
        message = decoder.decode(plans.recv_multipart(copy=False))
        if message is None:
            continue
        if isinstance(message, SchedulerOutput):
            try:
                runner.execute(message)
            except StepFault as fault:
                if not fault.ranks_agree:
                    raise
                # The first rank failed the same step alike; it resets the encoder caches next.
        elif isinstance(message, ResetEncoderCache):
            runner.reset_encoder_cache()
        elif isinstance(message, InjectFaults):
            runner.faults.apply(message.action, message.request_ids)
        elif isinstance(message, ReportHeldState):
            num_requests, keys = runner.held_state()
            reply.send_multipart(encoder.encode(RankHeldState(spec.rank, num_requests, [list(k) for k in keys])))
        elif isinstance(message, StopRank):
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an mmserve engine")
    parser.add_argument("--spec", help="JSON RankSpec (given by the first rank when it starts this rank)")
    parser.add_argument("--model", help="the checkpoint's directory on this node (default: the first rank's path)")
    args = parser.parse_args(argv)
    if args.spec:
        spec = RankSpec(**json.loads(args.spec))
    else:  # a rank on another node, by torchrun's conventions
        env = os.environ
        try:
            spec = RankSpec(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                store_host=env["MASTER_ADDR"],
                store_port=int(env["MASTER_PORT"]),
                model_dir=args.model,
            )
        except KeyError as exc:
            parser.error(f"without --spec, the environment must set {exc.args[0]} (torchrun's variables)")
    if spec.rank < 1:
        parser.error("rank 0 is the engine core itself (`mmserve serve --tensor-parallel-size N`)")
    return run_rank(spec)


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # everything is released above; skip tearing down torch's modules (about a second)
