"""Decodes untrusted media in worker processes (`decode_worker.py`), each item under a wall-clock and a
memory limit, so a decoder that hangs, crashes or runs out of memory fails that item only.

Owns the workers' lifecycle (spawned on demand or by `start()`, killed and replaced, stopped by
`close()`), the wire protocol to them (JSON headers + raw pixel bytes: nothing from a worker is ever
unpickled) and the errors of a failed item. Knows nothing of models, the engine or HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

import mmserve
from mmserve.encoders.media import (
    DecodedVideo,
    MediaLimits,
    VideoPlan,
    check_resize,
    encoded_source,
    load_image,
    load_video,
    plan_video,
)
from mmserve.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

_SPAWN_TIMEOUT_S = 60.0  # interpreter start + numpy / Pillow / PyAV imports; about 0.5 s when idle
_MAX_REPLY_HEADER = 1 << 24  # a video header lists one timestamp per frame
# Environment of every worker: one malloc arena per thread would reserve 64 MiB of address space each
# and trip RLIMIT_AS on many-core machines; BLAS threads are useless for decoding.
_WORKER_ENV = {"MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@dataclass(frozen=True)
class ImageInfo:
    """What validating an upload learns of an image: it decoded completely, at this size."""

    width: int
    height: int


@dataclass(frozen=True)
class VideoInfo:
    """What validating an upload learns of a video: headers and first frame decoded."""

    width: int
    height: int
    duration_s: float
    source_fps: float


class _Worker:
    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection, generation: int) -> None:
        self.proc, self.conn, self.generation = proc, conn, generation

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, close_conn: bool = True) -> None:
        """SIGKILL (no-op if it has exited) and reap: no zombie is left behind. `close_conn=False` when
        another thread may be waiting on the connection: it sees EOF and closes it itself."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        if close_conn:
            self.conn.close()

    def stop(self, timeout: float) -> None:
        """Close the connection (the worker exits on EOF); kill it if it has not gone within `timeout`."""
        self.conn.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


class _Failed(Exception):
    """A job's worker did not answer normally: `reason` is timeout, crash, oom or failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DecodePool:
    """Thread-safe: `load_image` / `load_video` / `plan_video` / `probe_*` block the calling thread (run
    them off the event loop) and at most `workers` items decode at once; the others wait for a free worker."""

    def __init__(self, workers: int = 2, timeout_s: float = 30.0, memory_mib: int = 4096) -> None:
        if workers < 1 or not (timeout_s > 0 and math.isfinite(timeout_s)) or memory_mib < 1:
            raise ValueError(f"bad decode pool sizing: {workers=} {timeout_s=} {memory_mib=}")
        self.workers, self.timeout_s, self.memory_mib = workers, timeout_s, memory_mib
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []  # LIFO: the warmest worker first
        self._all: set[_Worker] = set()  # idle + busy; every process this pool has not yet reaped
        self._starting = 0  # slots reserved by spawns in progress
        self._generation = 0  # bumped by close(): a worker of an older generation is never reused
        self.num_replaced = 0  # workers killed or lost after a hang, crash or memory overrun
        # Reaps the workers if the pool is dropped or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    @classmethod
    def for_limits(cls, limits: MediaLimits) -> DecodePool:
        return cls(limits.decode_workers, limits.decode_timeout_s, limits.decode_memory_mib)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn workers up to `workers` now (in parallel) instead of on first use."""
        with self._cond:
            missing = self.workers - len(self._all) - self._starting
            self._starting += max(0, missing)
            generation = self._generation
        spawned: list[_Worker] = []
        try:
            launched: list[_Worker] = []
            try:  # all interpreters start at once; then each says it is ready
                for _ in range(max(0, missing)):
                    launched.append(_Worker(*self._launch(), generation))
            except BaseException:
                for worker in launched:
                    worker.kill()
                raise
            for i, worker in enumerate(launched):
                try:
                    spawned.append(self._handshake(worker.proc, worker.conn, generation))
                except BaseException:
                    for rest in launched[i + 1 :]:
                        rest.kill()
                    raise
        finally:
            with self._cond:
                self._starting -= max(0, missing)
                for worker in spawned:
                    if worker.generation == self._generation:
                        self._all.add(worker)
                        self._idle.append(worker)
                    else:
                        worker.kill()
                self._cond.notify_all()

    def close(self, timeout: float = 2.0) -> None:
        """Stop every worker and reap it. Items in flight fail with `EngineDeadError`. A later call spawns
        fresh workers (the pool can be reused, e.g. by an engine that outlives one server)."""
        with self._cond:
            self._generation += 1
            idle, self._idle = self._idle, []
            busy = [w for w in self._all if w not in idle]
            self._all.clear()
            self._cond.notify_all()
        for worker in busy:
            worker.kill(close_conn=False)  # its caller, blocked on the connection, sees EOF
        for worker in idle:
            worker.stop(timeout)

    def worker_pids(self) -> list[int]:
        with self._cond:
            return sorted(w.pid for w in self._all)

    # -- decoding -------------------------------------------------------------------------------------
    def load_image(
        self, source: object, limits: MediaLimits, *, item: str = "image", param: str | None = None
    ) -> Image.Image:
        """`media.load_image` in a worker: the same RGB pixels. A PIL image (already decoded by the
        caller's own code, never by a client's bytes) is converted in this process."""
        if isinstance(source, Image.Image):
            return load_image(source, limits, item=item, param=param)
        encoded = encoded_source(source, "image", limits, item=item, param=param)  # type: ignore[arg-type]
        _, pixels = self._run("image", encoded, limits, item, param)
        assert pixels is not None
        return Image.fromarray(pixels, mode="RGB")

    def load_video(
        self,
        source: object,
        limits: MediaLimits,
        *,
        item: str = "video",
        param: str | None = None,
        array_fps: float | None = None,
        resize_to: tuple[int, int] | None = None,
        resample: int = 3,
    ) -> DecodedVideo:
        """`media.load_video` in a worker: the same frames and timing, resized there when `resize_to` =
        (height, width) is given (only frames of that size cross the connection). A uint8 array is checked
        here (there is nothing to decode)."""
        check_resize(resize_to, resample)
        if isinstance(source, np.ndarray):
            return load_video(
                source, limits, item=item, param=param, array_fps=array_fps, resize_to=resize_to,
                resample=resample,
            )  # fmt: skip
        encoded = encoded_source(source, "video", limits, item=item, param=param)  # type: ignore[arg-type]
        resize = None if resize_to is None else [int(resize_to[0]), int(resize_to[1])]
        extra = {"resize_to": resize, "resample": int(resample)}
        header, frames = self._run("video", encoded, limits, item, param, extra)
        assert frames is not None
        return DecodedVideo(
            frames=frames,
            fps=_float(header, "fps"),
            source_fps=_float(header, "source_fps"),
            duration_s=_float(header, "duration_s"),
            timestamps_s=tuple(float(t) for t in header["timestamps_s"]),
        )

    def plan_video(
        self,
        source: object,
        limits: MediaLimits,
        *,
        item: str = "video",
        param: str | None = None,
        array_fps: float | None = None,
    ) -> VideoPlan:
        """`media.plan_video` in a worker (the container is parsed there, never here): what `load_video`
        will return, before any frame is decoded. A uint8 array is planned here from its shape."""
        if isinstance(source, np.ndarray):
            return plan_video(source, limits, item=item, param=param, array_fps=array_fps)
        encoded = encoded_source(source, "video", limits, item=item, param=param)  # type: ignore[arg-type]
        header, _ = self._run("plan_video", encoded, limits, item, param)
        return VideoPlan(
            width=header["width"],
            height=header["height"],
            num_frames=header["num_frames"],
            fps=_float(header, "fps"),
            source_fps=_float(header, "source_fps"),
            duration_s=_float(header, "duration_s"),
        )

    def probe_image(
        self, path: Path, limits: MediaLimits, *, item: str = "file", param: str | None = None
    ) -> ImageInfo:
        """Decode the whole image in a worker; only its size comes back."""
        encoded = encoded_source(path, "image", limits, item=item, param=param)
        header, _ = self._run("probe_image", encoded, limits, item, param)
        height, width = header["shape"][:2]
        return ImageInfo(width=width, height=height)

    def probe_video(
        self, path: Path, limits: MediaLimits, *, item: str = "file", param: str | None = None
    ) -> VideoInfo:
        """Headers and the first frame in a worker, every limit checked; no pixels come back."""
        limits = replace(limits, max_video_frames=1)  # load_video then decodes only the first frame
        encoded = encoded_source(path, "video", limits, item=item, param=param)
        header, _ = self._run("probe_video", encoded, limits, item, param)
        _, height, width, _ = header["shape"]
        return VideoInfo(width, height, _float(header, "duration_s"), _float(header, "source_fps"))

    # -- internals ------------------------------------------------------------------------------------
    def _run(
        self,
        op: str,
        encoded: bytes | Path,
        limits: MediaLimits,
        item: str,
        param: str | None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """One job on one worker -> (reply header, pixels for image / video ops). `extra`: more job fields
        (a video's resize_to and resample). A worker that dies while idle (e.g. killed from outside) costs
        one retry on a fresh worker, never the item."""
        job = {
            "op": op, "limits": asdict(limits), "item": item,
            "path": str(encoded) if isinstance(encoded, Path) else None, **(extra or {}),
        }  # fmt: skip
        payload = b"" if isinstance(encoded, Path) else encoded
        for attempt in range(2):
            worker = self._acquire()
            try:
                worker.conn.send_bytes(json.dumps(job).encode())
                worker.conn.send_bytes(payload)
            except OSError:  # it was dead before it saw the job
                self._retire(worker, "lost")
                if attempt == 0:
                    continue
                raise self._error(item, param, "crash", worker) from None
            try:
                header, pixels = self._receive(worker, op, limits, job.get("resize_to"))
            except _Failed as failed:
                self._retire(worker, failed.reason)
                raise self._error(item, param, failed.reason, worker) from None
            if header["status"] == "invalid":
                self._release(worker)
                message = str(header.get("message", ""))[:1000]
                if not message.startswith(f"{item}: "):  # a worker only ever sends media.py's messages
                    message = f"{item}: could not be decoded"
                raise InvalidRequestError(message, param=param)
            if header["status"] == "ok":
                self._release(worker)
                return header, pixels
            reason = "oom" if header["status"] == "oom" else "failed"
            self._retire(worker, reason)
            raise self._error(item, param, reason, worker)
        raise AssertionError("unreachable")

    def _receive(
        self, worker: _Worker, op: str, limits: MediaLimits, resize_to: list[int] | None = None
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """The worker's reply within the item's time limit. Raises `_Failed`."""
        deadline = time.monotonic() + self.timeout_s
        try:
            if not worker.conn.poll(self.timeout_s):
                raise _Failed("timeout")
            header = json.loads(worker.conn.recv_bytes(_MAX_REPLY_HEADER))
            if not isinstance(header, dict) or header.get("status") not in ("ok", "invalid", "oom", "failed"):
                raise _Failed("failed")
            if header["status"] != "ok" or op.startswith(("probe_", "plan_")):
                _check_shape(header, op, limits, resize_to)
                return header, None
            shape = _check_shape(header, op, limits, resize_to)
            pixels = np.empty(shape, dtype=np.uint8)  # [H, W, 3] or [T, H, W, 3]
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                raise _Failed("timeout")
            received = worker.conn.recv_bytes_into(memoryview(pixels).cast("B"))
            if received != pixels.nbytes:
                raise _Failed("failed")
            return header, pixels
        except _Failed:
            raise
        except (EOFError, OSError):
            raise _Failed("crash") from None
        except Exception:  # a reply we cannot read (bad JSON, short or long buffer): drop the worker
            raise _Failed("failed") from None

    def _error(self, item: str, param: str | None, reason: str, worker: _Worker) -> Exception:
        if worker.generation != self._generation:
            return EngineDeadError("media decoding was shut down")
        if reason == "timeout":
            return InvalidRequestError(
                f"{item}: could not be decoded within {self.timeout_s:g} s (decode_timeout_s)", param=param
            )
        if reason == "oom":
            return InvalidRequestError(
                f"{item}: could not be decoded within {self.memory_mib} MiB of memory (decode_memory_mib)",
                param=param,
            )
        return InvalidRequestError(
            f"{item}: could not be decoded (the decoder failed on this data)", param=param
        )

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._idle:
                    return self._idle.pop()
                if len(self._all) + self._starting < self.workers:
                    self._starting += 1
                    generation = self._generation
                    break
                self._cond.wait()
        worker = None
        try:
            proc, conn = self._launch()
            worker = self._handshake(proc, conn, generation)
        finally:
            with self._cond:
                self._starting -= 1
                if worker is not None and worker.generation == self._generation:
                    self._all.add(worker)  # else close() ran meanwhile: _release kills it after this job
                self._cond.notify_all()
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if worker.generation == self._generation and worker in self._all:
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.kill()  # the pool was closed while it worked

    def _retire(self, worker: _Worker, reason: str) -> None:
        worker.kill()
        code = worker.proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        logger.warning("media decode worker %d replaced after %s (%s)", worker.pid, reason, how)
        with self._cond:
            if worker in self._all:
                self._all.discard(worker)
                self.num_replaced += 1
            self._cond.notify_all()

    def _launch(self) -> tuple[subprocess.Popen[bytes], Connection]:
        """Start one worker. Not `multiprocessing`: its spawn / forkserver children re-import the parent's
        `__main__` (for `mmserve serve`, the CLI and with it torch); a fresh interpreter running
        `decode_worker` imports only Pillow, PyAV and numpy. fork + exec is safe in a threaded process."""
        ours, theirs = socket.socketpair()
        root = str(Path(mmserve.__file__).resolve().parent.parent)
        env = {**os.environ, **_WORKER_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mmserve.encoders.decode_worker", str(theirs.fileno()), str(self.memory_mib)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=env, cwd="/",
                start_new_session=True,  # a terminal's Ctrl-C reaches the server, which then closes the pool
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return proc, Connection(ours.detach())

    def _handshake(self, proc: subprocess.Popen[bytes], conn: Connection, generation: int) -> _Worker:
        worker = _Worker(proc, conn, generation)
        try:
            if not conn.poll(_SPAWN_TIMEOUT_S):
                raise TimeoutError("no ready message")
            ready = json.loads(conn.recv_bytes(4096))
            if ready.get("ready") is not True:
                raise RuntimeError("bad ready message")
        except Exception as exc:
            worker.kill()
            raise EngineDeadError("a media decode worker could not be started") from exc
        return worker


def _check_shape(
    header: dict[str, Any], op: str, limits: MediaLimits, resize_to: list[int] | None = None
) -> tuple[int, ...]:
    """The reply's pixel shape, refused unless it is within the item's caps (so a confused worker cannot
    make this process allocate without bound); a resized video's frames must be exactly `resize_to`
    ([height, width]). A plan has no pixels: its counts are checked against the same caps."""
    if header.get("status") != "ok":
        return ()
    if op == "plan_video":
        ints = [header.get(k) for k in ("width", "height", "num_frames")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
            raise _Failed("failed")
        width, height, num_frames = ints
        if num_frames > limits.max_video_frames or width * height > limits.max_video_pixels_per_frame:
            raise _Failed("failed")
        for key in ("fps", "source_fps", "duration_s"):
            value = header.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _Failed("failed")
        return ()
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise _Failed("failed")
    if op.endswith("image"):
        if len(shape) != 3 or shape[2] != 3 or shape[0] * shape[1] > limits.max_image_pixels:
            raise _Failed("failed")
    elif (
        len(shape) != 4
        or shape[3] != 3
        or shape[0] > limits.max_video_frames
        or (
            shape[1] * shape[2] > limits.max_video_pixels_per_frame
            if resize_to is None
            else shape[1:3] != list(resize_to)
        )
        or len(header.get("timestamps_s", ())) != shape[0]
    ):
        raise _Failed("failed")
    return tuple(shape)


def _float(header: dict[str, Any], key: str) -> float:
    value = header[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError("video: could not be decoded")
    return float(value)


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()
