"""One media decode worker process (`python -m mmserve.encoders.decode_worker FD MEMORY_MIB`), started
by `decode_pool.DecodePool`: limits its own memory, then decodes one job at a time with `media.py`.

Imports only Pillow, PyAV and numpy (never torch or transformers). Speaks JSON headers and raw pixel
bytes over the connection on FD; nothing crossing it is pickled. Knows nothing of the engine or HTTP.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
from dataclasses import fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import av
import numpy as np

from mmserve.encoders.media import MediaLimits, load_image, load_video, plan_video
from mmserve.errors import InvalidRequestError

# Test hook, read only here: with this variable set to 1, a payload containing one of these markers makes
# the worker hang or crash, so tests can exercise the pool's kill-and-replace paths deterministically.
TEST_HOOKS_ENV = "MMSERVE_DECODE_TEST_HOOKS"
HANG_MARKER = b"mmserve-test-hook:hang"
CRASH_MARKER = b"mmserve-test-hook:crash"
_MAX_HEADER_BYTES = 1 << 16


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    memory_mib = int(argv[2])
    av.logging.set_level(None)  # FFmpeg's own messages (which quote the file) go nowhere
    _watch_parent(os.getppid())
    _limit_resources(memory_mib)
    hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    conn.send_bytes(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    while True:
        try:
            job = json.loads(conn.recv_bytes(_MAX_HEADER_BYTES))
            payload = conn.recv_bytes()
        except EOFError:
            return 0  # the pool closed the connection: shut down quietly
        except MemoryError:
            _reply(conn, {"status": "oom"})
            return 1  # the connection may hold half a message: a fresh worker replaces this one
        if hooks:
            _run_test_hooks(job, payload)
        _reset_peak_rss()
        try:
            header, pixels = _decode(job, payload)
        except InvalidRequestError as exc:
            _reply(
                conn, {"status": "invalid", "message": str(exc)}
            )  # mmserve's own text, never the decoder's
            continue
        except MemoryError:
            _reply(conn, {"status": "oom"})
            return 1  # the heap may be fragmented or half-freed: start afresh
        except Exception:
            _reply(conn, {"status": "failed"})  # a decoder error media.py did not wrap; its text stays here
            continue
        _reply(conn, {"status": "ok", **header, "max_rss_kib": _peak_rss_kib()}, pixels)


def _decode(job: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], np.ndarray | None]:
    """-> (reply header, pixels to send or None). `job`: op, limits, item, path (or the payload bytes),
    and for a video resize_to ([height, width] or null) and resample."""
    names = {f.name for f in fields(MediaLimits)}
    limits = MediaLimits(**{k: v for k, v in job["limits"].items() if k in names})
    source: bytes | Path = Path(job["path"]) if job.get("path") else payload
    item, op = str(job["item"]), job["op"]
    if op in ("image", "probe_image"):
        rgb = np.asarray(load_image(source, limits, item=item))  # [H, W, 3] uint8
        header = {"shape": list(rgb.shape)}
        return header, (np.ascontiguousarray(rgb) if op == "image" else None)
    if op == "plan_video":
        plan = plan_video(source, limits, item=item)
        header = {
            "width": plan.width, "height": plan.height, "num_frames": plan.num_frames, "fps": plan.fps,
            "source_fps": plan.source_fps, "duration_s": plan.duration_s,
        }  # fmt: skip
        return header, None
    if op in ("video", "probe_video"):
        resize_to = job.get("resize_to")
        resize = (int(resize_to[0]), int(resize_to[1])) if resize_to else None
        video = load_video(source, limits, item=item, resize_to=resize, resample=int(job.get("resample", 3)))
        header = {
            "shape": list(video.frames.shape),  # [T, H, W, 3]
            "fps": video.fps, "source_fps": video.source_fps, "duration_s": video.duration_s,
            "timestamps_s": list(video.timestamps_s),
        }  # fmt: skip
        return header, (np.ascontiguousarray(video.frames) if op == "video" else None)
    raise ValueError(f"unknown op {op!r}")


def _reply(conn: Connection, header: dict[str, Any], pixels: np.ndarray | None = None) -> None:
    conn.send_bytes(json.dumps(header).encode())
    if pixels is not None:
        conn.send_bytes(memoryview(pixels).cast("B"))  # raw bytes: the pool reads them into its own array


def _reset_peak_rss() -> None:
    """Start this job's peak resident size afresh (Linux: "5" to clear_refs resets VmHWM), so each reply's
    `max_rss_kib` is that item's own peak. Best effort: elsewhere it is the peak since the worker began."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_kib() -> int | None:
    """Peak resident size (KiB), for diagnostics. VmHWM, not getrusage's ru_maxrss: Linux carries the
    parent's size across fork + exec into ru_maxrss, so a worker spawned by a large server would report
    the server's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _limit_resources(memory_mib: int) -> None:
    """RLIMIT_AS = the address space after imports + `memory_mib`: the budget is what one item may add,
    whatever the libraries' idle footprint on this machine. No core files from a crashing decoder."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * page
    limit = vm_bytes + memory_mib * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _watch_parent(parent: int) -> None:
    """Exit when the pool's process is gone, even in the middle of a decode (an idle worker also sees
    EOF on its connection)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _run_test_hooks(job: dict[str, Any], payload: bytes) -> None:
    data = payload
    if job.get("path"):
        try:
            data = Path(job["path"]).read_bytes()
        except OSError:
            return
    if HANG_MARKER in data:
        while True:
            time.sleep(60)
    if CRASH_MARKER in data:
        os.kill(os.getpid(), signal.SIGSEGV)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
