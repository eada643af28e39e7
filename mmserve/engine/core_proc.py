"""The engine core's serving loop: receive messages, step, send outputs — in its own process
(`mmserve serve`'s default) or on a thread (`--no-engine-process`, tests), over the same ZeroMQ sockets.

Sockets: the core binds one PULL socket (`input_address`) that every front end's PUSH connects to; each
front end binds its own PULL socket and says where in its `Hello`; the core connects a PUSH to it.
When a front end's process dies, the core aborts that front end's requests and frees their blocks.
When the core's parent process dies, the core exits (it never outlives its server).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from mmserve.config import EngineArgs
from mmserve.engine.messages import CoreLoopStats, EngineCoreOutputs
from mmserve.engine.serial import Decoder, Encoder
from mmserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreInput,
    Hello,
    MediaMirror,
    Ready,
    RequestRejected,
    Shutdown,
    StartFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    request_from_wire,
)
from mmserve.errors import InvalidRequestError, MMServeError
from mmserve.gc_heap import startup_heap_frozen
from mmserve.request import RequestStatus
from mmserve.scheduler.slo import SloInfeasibleError

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 200  # how often an idle core checks that its front ends are alive
_LIVENESS_EVERY_S = 0.5  # ... and a busy one
_STALLED_POLL_MS = 5  # requests are held but nothing can be scheduled (e.g. waiting for blocks)


@dataclass
class _Client:
    """One front end as the core sees it."""

    index: int
    socket: zmq.Socket
    pid: int
    media: MediaMirror = field(default_factory=MediaMirror)
    request_ids: set[str] = field(default_factory=set)


class CoreServer:
    """Runs an `EngineCore` behind the sockets until `Shutdown`, the parent's death or an escape."""

    def __init__(self, core: Any, context: zmq.Context, input_socket: zmq.Socket) -> None:
        self.core = core
        self.context = context
        self.input = input_socket
        self.clients: dict[int, _Client] = {}
        self.owner: dict[str, int] = {}  # request id -> client index
        self.encoder = Encoder()
        self.decoder = Decoder(CoreInput)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self._next_liveness = 0.0
        self.info = core.info()
        # CoreLoopStats, cumulative: published with every step's outputs.
        self.step_s = self.io_s = self.idle_s = 0.0
        self.num_steps = self.bytes_out = 0
        self._stalled = False
        self._last_stats: Any = None

    def serve(self, parent_sentinel: int | None = None) -> None:
        if parent_sentinel is not None:
            self.poller.register(parent_sentinel, zmq.POLLIN)
        self._parent_sentinel = parent_sentinel
        clock = time.perf_counter
        while True:
            busy = self.core.has_unfinished_requests() or self.core.has_pending_kv_transfers()
            t0 = clock()
            events = dict(self.poller.poll(0 if busy else _IDLE_POLL_MS))
            t1 = clock()
            if not busy:
                self.idle_s += t1 - t0
                self.core.publish_kv_events()  # a router subscribing to an idle replica gets its cache
            if parent_sentinel is not None and parent_sentinel in events:
                logger.warning("the engine core's parent process died: exiting")
                return
            if self.input in events and self._drain_inputs():
                return
            if busy and not events and self._stalled:
                self.poller.poll(_STALLED_POLL_MS)  # requests, none schedulable: wait for a message, don't spin
            now = time.monotonic()
            if now >= self._next_liveness:
                self._next_liveness = now + _LIVENESS_EVERY_S
                self._reap_dead_clients()
                self.core.check_health()  # a dead tensor-parallel rank ends the core, also when idle
            t2 = clock()
            self.io_s += t2 - t1
            if self.core.has_unfinished_requests() or self.core.has_pending_kv_transfers():
                step = self.core.step()
                t3 = clock()
                self.step_s += t3 - t2
                # A step that ran nothing and changed nothing is not sent (and the loop backs off).
                self._stalled = step.step is None and not step.outputs and step.stats == self._last_stats
                if not self._stalled:
                    self._last_stats = step.stats
                    self._publish(step)
                self.io_s += clock() - t3

    # -- inputs ---------------------------------------------------------------------------------------
    def _drain_inputs(self) -> bool:
        """Handle every message that has arrived. True on Shutdown."""
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            try:
                message = self.decoder.decode(frames)
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable message")
                continue
            if isinstance(message, Shutdown):
                return True
            self._handle(message)

    def _handle(self, message: Any) -> None:
        if isinstance(message, Hello):
            old = self.clients.pop(message.client_index, None)
            if old is not None:  # the same front end again (restarted): what it had is orphaned
                self.core.abort_requests(list(old.request_ids))
                self._forget(list(old.request_ids))
                old.socket.close(linger=0)
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(message.output_address)
            self.clients[message.client_index] = _Client(message.client_index, socket, message.pid)
            self._send(self.clients[message.client_index], Ready(self.info))
        elif isinstance(message, AddRequest):
            client = self.clients.get(message.client_index)
            if client is None:
                logger.error("a request from front end %d, which never said hello", message.client_index)
                return
            request_id = message.request.request_id
            try:
                request = request_from_wire(message.request, client.media)
                self.core.add_request(request)
            except MMServeError as exc:
                param = exc.param if isinstance(exc, InvalidRequestError) else None
                retry_after_s = exc.retry_after_s if isinstance(exc, SloInfeasibleError) else None
                self._send(client, RequestRejected(request_id, type(exc).__name__, str(exc), param, retry_after_s))
                return
            except Exception:  # a malformed message: this request only (the detail stays in this log)
                logger.exception("request %s could not be added", request_id)
                message = "the request failed inside the engine"
                self._send(client, RequestRejected(request_id, "RequestFailedError", message))
                return
            client.request_ids.add(request_id)
            self.owner[request_id] = client.index
        elif isinstance(message, AbortRequests):
            status = RequestStatus.FINISHED_STOPPED if message.stopped else RequestStatus.FINISHED_ABORTED
            self.core.abort_requests(message.request_ids, status)
            self._forget(message.request_ids)
        elif isinstance(message, UtilityCall):
            client = self.clients.get(message.client_index)
            try:
                result = UtilityResult(message.call_id, self.core.call_utility(message.method, message.args))
            except Exception as exc:
                result = UtilityResult(message.call_id, error=f"{type(exc).__name__}: {exc}")
            if client is not None:
                self._send(client, result)

    # -- outputs --------------------------------------------------------------------------------------
    def _publish(self, step: EngineCoreOutputs) -> None:
        """Each front end gets its requests' outputs; all of them get the stats and the step record."""
        by_client: dict[int, list] = {index: [] for index in self.clients}
        finished = []
        for out in step.outputs:
            index = self.owner.get(out.request_id)
            if index is not None and index in by_client:
                by_client[index].append(out)
            if out.finished:
                finished.append(out.request_id)
        self._forget(finished)
        self.num_steps += 1
        loop = CoreLoopStats(self.step_s, self.io_s, self.idle_s, self.num_steps, self.bytes_out)
        # The step record goes to one front end only: with several, their metrics are summed.
        first = min(by_client, default=None)
        for index, outputs in by_client.items():
            record = step.step if index == first else None
            message = StepOutputs(EngineCoreOutputs(tuple(outputs), step.stats, record, loop))
            self._send(self.clients[index], message)

    def announce_death(self, exc: BaseException) -> None:
        """Tells every front end that the loop escaped (`CoreDead`), before the sockets close."""
        message = CoreDead(f"{type(exc).__name__}: {exc}")
        for client in self.clients.values():
            with contextlib.suppress(Exception):  # dying anyway: a front end that cannot hear it sees the exit
                self._send(client, message)

    def _send(self, client: _Client, message: Any) -> None:
        frames = self.encoder.encode(message)
        self.bytes_out += sum(len(f) for f in frames)
        client.socket.send_multipart(frames, copy=False)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            index = self.owner.pop(request_id, None)
            if index is not None and index in self.clients:
                self.clients[index].request_ids.discard(request_id)

    def _reap_dead_clients(self) -> None:
        """A front end whose process is gone: abort its requests (their blocks are freed now)."""
        for index, client in list(self.clients.items()):
            if pid_alive(client.pid):
                continue
            logger.warning("front end %d (pid %d) is gone: aborting its %d requests", index, client.pid,
                           len(client.request_ids))  # fmt: skip
            self.core.abort_requests(list(client.request_ids))
            self._forget(list(client.request_ids))
            client.socket.close(linger=0)
            del self.clients[index]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (a front end the launcher has not reaped yet) is dead too.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    return True


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    *,
    context: zmq.Context | None = None,
    in_process: bool = False,
    ready: Any = None,
    directory: str | None = None,
) -> None:
    """The core's entry point (a spawned process's target, or a thread's). Binds `input_address`,
    builds the core (answering each `Hello` with `StartFailed` if that fails) and serves. `directory`: the
    core's socket directory, removed when it exits (its starter may already be dead)."""
    if not in_process:
        # Ctrl-C or a SIGTERM to the server's process group (a terminal, systemd, `kill -- -pgid`) must not
        # end the core before the server has drained: it leaves the group, and stops on `Shutdown` or
        # when its parent dies. A SIGTERM sent to it alone still ends it (multiprocessing's cleanup).
        os.setpgrp()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s engine-core: %(message)s")
    own_context = context is None
    context = context or zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(input_address)
    if ready is not None:
        ready.set()
    try:
        try:
            from mmserve.engine.core import EngineCore

            core = EngineCore(args)
        except Exception as exc:
            logger.exception("the engine core failed to start")
            _refuse_hellos(context, socket, f"the engine failed to start: {type(exc).__name__}: {exc}")
            return
        server = CoreServer(core, context, socket)
        parent = multiprocessing.parent_process()
        try:
            with startup_heap_frozen("engine core"):
                server.serve(parent.sentinel if parent is not None and not in_process else None)
        except BaseException as exc:
            server.announce_death(exc)
            raise
        finally:
            for client in server.clients.values():
                client.socket.close(linger=1000)
            core.close()  # no tensor-parallel rank outlives the core
    finally:
        socket.close(linger=0)
        if own_context:
            context.destroy(linger=1000)  # never blocks on a socket left open by an escape
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _refuse_hellos(context: zmq.Context, socket: zmq.Socket, message: str, wait_s: float = 5.0) -> None:
    """Tell each front end that says hello within `wait_s` why the core is not coming."""
    decoder, encoder = Decoder(CoreInput), Encoder()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not socket.poll(100):
            continue
        hello = decoder.decode(socket.recv_multipart(copy=False))
        if isinstance(hello, Hello):  # every front end that says hello in time hears why
            out = context.socket(zmq.PUSH)
            out.connect(hello.output_address)
            out.send_multipart(encoder.encode(StartFailed(message)))
            out.close(linger=2000)
