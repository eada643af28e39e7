"""A front end's connection to the engine core: starts it (a spawned process, or a thread), says hello,
sends typed messages and receives the core's, and watches that the core is alive.

Thread-safety: `send_*` may be called from any thread (one lock guards the PUSH socket); `recv` belongs
to one thread (the front end's output thread).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import zmq

from mmserve.config import EngineArgs
from mmserve.engine.core_proc import pid_alive, run_engine_core
from mmserve.engine.ipc import socket_directory
from mmserve.engine.messages import EngineInfo
from mmserve.engine.serial import Decoder, Encoder
from mmserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreOutput,
    Hello,
    MediaMirror,
    Ready,
    Shutdown,
    StartFailed,
    UtilityCall,
    request_to_wire,
)
from mmserve.errors import EngineDeadError
from mmserve.request import Request

_START_TIMEOUT_S = 600.0  # loading a big checkpoint takes a while


@dataclass(frozen=True)
class CoreHandle:
    """An engine core started by someone else (the `--api-server-count` launcher): where it listens and
    its process id (for liveness checks from a sibling process)."""

    input_address: str
    pid: int
    # The core's socket directory (private to this user): its input and every front end's output socket. The
    # core removes it when it exits, and its launcher once the core is gone (whichever dies first, the
    # directory goes with the last of them: a front end or launcher killed outright leaves nothing behind).
    directory: str = ""


def start_engine_core(args: EngineArgs) -> tuple[multiprocessing.process.BaseProcess, CoreHandle]:
    """Spawn an engine-core process; returns it and how to reach it (its `directory` is the caller's
    to remove once the core is gone; the core removes it too when it exits)."""
    directory = socket_directory("mmserve-core-")
    address = f"ipc://{directory}/input"
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        args=(args, address),
        kwargs={"directory": directory},
        name="mmserve-engine-core",
        daemon=True,
    )
    process.start()
    assert process.pid is not None
    return process, CoreHandle(address, process.pid, directory)


class EngineCoreClient:
    """`core`: connect to that running core as front end `client_index`; None: start a core of our own,
    in a spawned process (`engine_process`) or on a thread."""

    def __init__(
        self,
        args: EngineArgs,
        *,
        engine_process: bool = True,
        client_index: int = 0,
        core: CoreHandle | None = None,
    ) -> None:
        self.client_index = client_index
        self._process: Any = None
        self._thread: threading.Thread | None = None
        self._sibling_pid = core.pid if core is not None else None  # a core we do not own
        # Our output socket goes in the core's socket directory (see CoreHandle), so that it goes when the core
        # does even if this process is killed; where the core has none, in a directory of our own. `owned`: the
        # directories this client removes, at close() or at interpreter exit for a client never closed (a script
        # that just ends: multiprocessing then terminates the core without running its own cleanup).
        owned: list[str] = []
        if core is None and engine_process:
            self._process, own = start_engine_core(args)
            input_address, sockets = own.input_address, own.directory
            owned.append(sockets)
        elif core is not None and core.directory:
            input_address, sockets = core.input_address, core.directory
        else:  # a core on a thread, or a sibling core without a directory
            sockets = socket_directory("mmserve-frontend-")
            owned.append(sockets)
            input_address = core.input_address if core is not None else f"ipc://{sockets}/input"
        output_address = f"ipc://{sockets}/output-{client_index}-{uuid.uuid4().hex[:8]}"
        self._remove_directories = weakref.finalize(self, _remove_directories, owned)
        self.context = zmq.Context()
        self._pull = self.context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(output_address)
        self._recv_timeout_ms = -1  # the PULL socket's RCVTIMEO (-1: zmq's default, blocking)
        self._push = self.context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._send_lock = threading.Lock()
        self._encoder = Encoder()
        self._decoder = Decoder(CoreOutput)
        self._media = MediaMirror()
        if core is None and not engine_process:
            bound = threading.Event()
            self._thread = threading.Thread(
                target=run_engine_core,
                args=(args, input_address),
                kwargs={"context": self.context, "in_process": True, "ready": bound},
                name="mmserve-engine-core",
                daemon=True,
            )
            self._thread.start()
            bound.wait(30)
        self._push.connect(input_address)
        self._send(Hello(client_index, output_address, os.getpid()))
        self.info: EngineInfo = self._wait_ready()

    # -- sending (any thread) ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        with self._send_lock:  # the media mirror's order is the socket's order
            wire, commit = request_to_wire(request, self._media)
            self._push.send_multipart(self._encoder.encode(AddRequest(self.client_index, wire)), copy=False)
            commit()  # only once it is on its way, as the core will apply it

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids), stopped))

    def call_utility(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        self._send(UtilityCall(self.client_index, call_id, method, args))

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._push.send_multipart(self._encoder.encode(message), copy=False)

    # -- receiving (the output thread) -------------------------------------------------------------
    def recv(self, timeout_s: float) -> Any:
        """The next message from the core, or None after `timeout_s`. One blocking receive with the socket's
        timeout: no poller is built and polled per message (this runs once a token at one stream)."""
        timeout_ms = int(timeout_s * 1000)
        if timeout_ms != self._recv_timeout_ms:
            self._pull.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._recv_timeout_ms = timeout_ms
        try:
            frames = self._pull.recv_multipart(copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(frames)

    def core_alive(self) -> bool:
        if self._process is not None:
            return self._process.is_alive()
        if self._sibling_pid is not None:
            return pid_alive(self._sibling_pid)
        return self._thread is not None and self._thread.is_alive()

    @property
    def core_pid(self) -> int | None:
        if self._sibling_pid is not None:
            return self._sibling_pid
        return self._process.pid if self._process is not None else None

    def _wait_ready(self) -> EngineInfo:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self.recv(0.2)
            if isinstance(message, Ready):
                return message.info
            if isinstance(message, StartFailed):
                self.close()
                raise EngineDeadError(message.message)
            if not self.core_alive():
                code = self._process.exitcode if self._process is not None else None
                self.close()
                raise EngineDeadError(f"the engine core exited while starting (exit code {code})")
        self.close()
        raise EngineDeadError(f"the engine core was not ready within {_START_TIMEOUT_S:.0f} s")

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop (one we started), wait for it (kill it after `timeout_s`), close the
        sockets. A core shared with other front ends is left to its launcher."""
        if self.core_alive() and self._sibling_pid is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(Shutdown())
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        elif self._thread is not None:
            self._thread.join(timeout_s)
        with self._send_lock:
            self._push.close(linger=0)
        self._pull.close(linger=0)
        if self._thread is None or not self._thread.is_alive():
            self.context.term()
        self._remove_directories()


def _remove_directories(directories: list[str]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
