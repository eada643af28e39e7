"""Hostile media against the live server (tiny model) and the decode pool: mutated PNG / JPEG / GIF / WEBP /
MP4 / WEBM files (bit flips, truncation, header lies, absurd sizes) through uploads and data URLs answer
2xx or 4xx with mmserve's own words; a decoder that hangs, crashes or exhausts its memory costs one item,
its worker is replaced, and afterwards the engine holds nothing and no worker process is left behind."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.decode_worker import CRASH_MARKER, HANG_MARKER, TEST_HOOKS_ENV
from mmserve.encoders.media import MediaLimits, load_image, load_video
from mmserve.engine.async_engine import AsyncEngine
from mmserve.errors import EngineDeadError, InvalidRequestError

KEY = "sk-fuzz"
TIMEOUT_S = 2.0  # per-item decode limit in these tests: a hang costs this long
MEMORY_MIB = 256  # per-item memory: a 7000 x 7000 PNG (~390 MB to decode and convert) does not fit
LIMITS = MediaLimits(
    max_items_per_prompt=2, decode_workers=2, decode_timeout_s=TIMEOUT_S, decode_memory_mib=MEMORY_MIB
)
# Text that only a decoder (Pillow, FFmpeg / PyAV, zlib, the OS) would write; none may reach a client.
DECODER_TEXT = re.compile(
    r"traceback|errno|ffmpeg|libav|avcodec|invalid data found|cannot identify|image file is truncated|"
    r"broken data stream|oserror|syntaxerror|struct\.error|exception|moov atom|ebml|decompress|"
    r"unrecognized|end of file|error -\d|\bPIL\b|\bav\.",
    re.IGNORECASE,
)
OUR_PREFIXES = ("file: ", "image 0: ", "video 0: ", "messages", "prompt")


# ------------------------------------------------------------------------------------------ seed files


def noise(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)  # [H, W, 3]


def encode_image(fmt: str, rgb: np.ndarray | None = None, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(noise() if rgb is None else rgb)
    if fmt == "GIF":  # two frames: an animation, of which the decoder keeps the first
        kw = {"save_all": True, "append_images": [Image.fromarray(noise(seed=1))], "duration": 100, **kw}
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def encode_clip(fmt: str, codec: str, num_frames: int = 8, fps: int = 4) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(noise(seed=i), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_text(text: bytes) -> bytes:
    """A valid PNG carrying `text` in a tEXt chunk (before IEND)."""
    png = encode_image("PNG")
    return png[:-12] + png_chunk(b"tEXt", b"Comment\x00" + text) + png[-12:]


def jpeg_scan_bomb(repeats: int = 60_000) -> bytes:
    """A real decoder hang: a 2048 x 2048 progressive JPEG whose AC scan is repeated `repeats` times.
    Each scan is a few bytes (all blocks zero) but makes libjpeg walk every block again: ~1.2 MB that
    take about a minute to decode on a 2-core machine, far beyond any test's decode limit."""
    buf = io.BytesIO()
    Image.new("L", (2048, 2048)).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    scans: list[tuple[int, int]] = []  # [start, end) of each SOS segment with its entropy-coded data
    i = 2
    while data[i + 1] != 0xD9:  # EOI
        end = i + 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
        if data[i + 1] == 0xDA:  # entropy data runs to the next marker (not a stuffed 0 or an RST)
            while not (data[end] == 0xFF and data[end + 1] != 0 and not 0xD0 <= data[end + 1] <= 0xD7):
                end += 1
            scans.append((i, end))
        i = end
    ac = next((a, b) for a, b in scans if data[a + 5 + 2 * data[a + 4]] > 0)  # spectral start Ss > 0
    return data[: scans[-1][0]] + data[ac[0] : ac[1]] * repeats + data[scans[-1][0] :]


SEEDS: dict[str, tuple[str, bytes]] = {  # name -> (kind, bytes)
    "png": ("image", encode_image("PNG")),
    "jpeg": ("image", encode_image("JPEG", quality=90)),
    "gif": ("image", encode_image("GIF")),
    "webp": ("image", encode_image("WEBP", quality=80)),
    "mp4": ("video", encode_clip("mp4", "libx264")),
    "webm": ("video", encode_clip("webm", "libvpx-vp9")),
}


# ------------------------------------------------------------------------------------------ mutations


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def header_lies(name: str, data: bytes) -> list[tuple[str, bytes]]:
    """Headers that claim absurd or wrong sizes, durations and frame counts; the rest of the file unchanged."""
    lies: list[tuple[str, bytes]] = []
    if name == "png":  # IHDR width, height at 16..24; its CRC recomputed so only the sizes lie
        for w, h in ((65535, 65535), (1, 1), (128, 48), (0x7FFFFFFF, 1)):
            ihdr = struct.pack(">II", w, h) + data[24:29]
            lies.append((f"ihdr-{w}x{h}", data[:8] + png_chunk(b"IHDR", ihdr) + data[33:]))
    elif name == "gif":  # logical screen size (little-endian) at 6..10
        lies += [
            (f"screen-{w}x{h}", patch(data, 6, struct.pack("<HH", w, h))) for w, h in ((65535, 65535), (1, 1))
        ]
    elif name == "jpeg":  # baseline SOF0: height, width at +5, +7
        sof = data.index(b"\xff\xc0")
        lies += [
            (f"sof-{w}x{h}", patch(data, sof + 5, struct.pack(">HH", h, w)))
            for w, h in ((65500, 65500), (1, 1))
        ]
    elif name == "webp":  # VP8 key frame: 14-bit width, height after the start code 9d 01 2a
        start = data.index(b"\x9d\x01\x2a") + 3
        lies += [
            (f"vp8-{w}x{h}", patch(data, start, struct.pack("<HH", w, h)))
            for w, h in ((16383, 16383), (1, 1))
        ]
    elif name == "mp4":
        mdhd = (
            data.index(b"mdhd") + 4
        )  # version 0: flags(4) creation(4) modification(4) timescale(4) duration(4)
        lies.append(("mdhd-duration", patch(data, mdhd + 16, struct.pack(">I", 0xFFFFFFFF))))
        lies.append(("mdhd-timescale", patch(data, mdhd + 12, struct.pack(">I", 1))))
        mvhd = data.index(b"mvhd") + 4
        lies.append(("mvhd-duration", patch(data, mvhd + 16, struct.pack(">I", 0xFFFFFFFF))))
        stsz = data.index(b"stsz") + 4  # flags(4) sample_size(4) sample_count(4): the frame count
        lies.append(("stsz-count", patch(data, stsz + 8, struct.pack(">I", 0x7FFFFFFF))))
        lies.append(("stts-count", patch(data, data.index(b"stts") + 12, struct.pack(">I", 0x7FFFFFFF))))
        tkhd = data.index(b"tkhd") - 4  # width, height (16.16 fixed) are the box's last 8 bytes
        end = tkhd + struct.unpack(">I", data[tkhd : tkhd + 4])[0]
        lies.append(("tkhd-size", patch(data, end - 8, struct.pack(">II", 60000 << 16, 60000 << 16))))
    elif name == "webm":
        duration = data.find(b"\x44\x89\x88")  # Duration, an 8-byte float (milliseconds by default)
        if duration < 0:
            duration = data.index(b"\x44\x89\x84")  # or a 4-byte float
            lies.append(("duration", patch(data, duration + 3, struct.pack(">f", 1e12))))
        else:
            lies.append(("duration", patch(data, duration + 3, struct.pack(">d", 1e12))))
        lies.append(("ebml-size", patch(data, 4, b"\x01\xff\xff\xff\xff\xff\xff\xff")))
    return lies


def mutations(name: str, data: bytes) -> list[tuple[str, bytes]]:
    rng = random.Random(name)  # the same cases every run
    out: list[tuple[str, bytes]] = []
    for flips in (1, 8, 64):
        for rep in range(2):
            buf = bytearray(data)
            for _ in range(flips):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            out.append((f"flip{flips}.{rep}", bytes(buf)))
    for keep in (0.1, 0.5, 0.9, 0.99):
        out.append((f"trunc{keep}", data[: int(len(data) * keep)]))
    out.append(("trunc16", data[:16]))
    return out + header_lies(name, data)


def absurd_sizes() -> list[tuple[str, str, bytes]]:
    """Real files with sizes a model cannot take, and ones that only say so in their headers."""
    thin = encode_image("PNG", np.zeros((1, 20000, 3), np.uint8))  # aspect ratio 20000: preprocessing refuses
    tiny = encode_image("PNG", np.zeros((1, 1, 3), np.uint8))
    gif = encode_image("GIF", np.zeros((4, 4, 3), np.uint8))
    return [("png-1x20000", "image", thin), ("png-1x1", "image", tiny), ("gif-4x4", "image", gif)]


CASES = [
    (f"{name}-{mut}", kind, blob)
    for name, (kind, seed) in SEEDS.items()
    for mut, blob in mutations(name, seed)
]
CASES += [(f"{name}-valid", kind, seed) for name, (kind, seed) in SEEDS.items()]
CASES += absurd_sizes()


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def test_hooks() -> Iterator[None]:
    """Workers started while this is set obey the hang / crash markers (decode_worker.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TEST_HOOKS_ENV, "1")
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path], test_hooks: None) -> Iterator[AsyncEngine]:
    args = EngineArgs(str(tiny_model_dir("qwen2_vl")), max_num_batched_tokens=256, max_model_len=2048,
                      num_kv_blocks=256)  # fmt: skip
    engine = AsyncEngine(args, media_limits=LIMITS)
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> ServerSettings:
    return ServerSettings(
        api_key=KEY, data_dir=tmp_path_factory.mktemp("fuzz-data"), served_model_name="tiny"
    )


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, settings: ServerSettings) -> Iterator[ServerThread]:
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def pool(engine: AsyncEngine) -> DecodePool:
    mm = engine.processor.mm_processor
    assert mm is not None
    return mm.decoder


# ------------------------------------------------------------------------------------------ helpers


def upload(http: httpx.Client, data: bytes) -> httpx.Response:
    return http.post("/v1/files", files={"file": ("upload.bin", data, "application/octet-stream")})


def chat(http: httpx.Client, kind: str, data: bytes) -> httpx.Response:
    url = f"data:application/octet-stream;base64,{base64.b64encode(data).decode()}"
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    return http.post("/v1/chat/completions", json=body)


def check_answer(response: httpx.Response) -> str | None:
    """2xx, or a 4xx error in OpenAI's shape whose message is mmserve's own; returns that message."""
    assert response.status_code < 500, response.text
    if response.status_code < 400:
        return None
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert message.startswith(OUR_PREFIXES), message
    assert not DECODER_TEXT.search(message), message
    return message


def children(pids: set[int]) -> set[int]:
    """Those of `pids` that are still processes of ours, running or zombie (never reaped)."""
    alive = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():  # field 4: the parent's pid
            alive.add(pid)
    return alive


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------ the pool


def test_pool_decodes_bit_exactly_as_in_process(pool: DecodePool) -> None:
    for name, (kind, data) in SEEDS.items():
        if kind == "image":
            isolated = np.asarray(pool.load_image(data, LIMITS))
            assert np.array_equal(isolated, np.asarray(load_image(data, LIMITS))), name
        else:
            isolated_video, local = pool.load_video(data, LIMITS), load_video(data, LIMITS)
            assert np.array_equal(isolated_video.frames, local.frames), name
            assert isolated_video.frames.shape == local.frames.shape == (4, 48, 64, 3)  # 2 s at 2 fps
            assert (isolated_video.fps, isolated_video.source_fps, isolated_video.duration_s) == (
                local.fps, local.source_fps, local.duration_s,
            )  # fmt: skip
            assert isolated_video.timestamps_s == local.timestamps_s
    with pytest.raises(InvalidRequestError) as info:  # the same message as in-process
        pool.load_image(SEEDS["png"][1][:40], LIMITS, item="image 3", param="images")
    with pytest.raises(InvalidRequestError) as local_info:
        load_image(SEEDS["png"][1][:40], LIMITS, item="image 3", param="images")
    assert str(info.value) == str(local_info.value) and info.value.param == "images"


def test_pool_reads_paths_relative_to_the_callers_directory(
    pool: DecodePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.png").write_bytes(SEEDS["png"][1])
    monkeypatch.chdir(tmp_path)  # the workers run in "/"
    assert np.array_equal(np.asarray(pool.load_image("a.png", LIMITS)), np.asarray(load_image("a.png", LIMITS)))


def test_every_case_decodes_the_same_in_the_pool_as_in_process(pool: DecodePool) -> None:
    """Same pixels or the same message, isolated or not (these cases neither crash nor hang a decoder)."""

    def outcome(decode: Callable[[], np.ndarray]) -> tuple[str, Any]:
        try:
            return "ok", decode()
        except InvalidRequestError as exc:
            return "error", (str(exc), exc.param)

    replaced = pool.num_replaced
    for case, kind, data in CASES:
        if kind == "image":
            isolated = outcome(lambda d=data: np.asarray(pool.load_image(d, LIMITS, param="p")))
            local = outcome(lambda d=data: np.asarray(load_image(d, LIMITS, param="p")))
        else:
            isolated = outcome(lambda d=data: pool.load_video(d, LIMITS, param="p").frames)
            local = outcome(lambda d=data: load_video(d, LIMITS, param="p").frames)
        assert isolated[0] == local[0], (case, isolated, local)
        if isolated[0] == "ok" and (kind == "image" or case.endswith("-valid")):
            assert np.array_equal(isolated[1], local[1]), case
        elif isolated[0] == "ok":
            # A damaged stream decodes with FFmpeg's error concealment, which under frame threading
            # (thread_type AUTO) is not deterministic: the same file twice in one process can differ.
            assert isolated[1].shape == local[1].shape, case
        else:
            assert isolated[1] == local[1], case
    assert pool.num_replaced == replaced  # every failure above was a clean refusal inside the worker


def test_workers_import_neither_torch_nor_transformers(pool: DecodePool) -> None:
    pool.load_image(SEEDS["png"][1], LIMITS)
    for pid in pool.worker_pids():
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "torch" not in maps, pid
    # The worker's whole import graph, in a clean interpreter.
    code = "import sys, mmserve.encoders.decode_worker; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_hanging_item_does_not_hold_up_others() -> None:
    pool = DecodePool(workers=2, timeout_s=600.0, memory_mib=MEMORY_MIB)  # the hang lasts until close()
    pool.start()
    pids = set(pool.worker_pids())
    outcome: dict[str, BaseException | None] = {}

    def hang() -> None:
        try:
            pool.load_image(png_with_text(HANG_MARKER), LIMITS, item="image 0")
            outcome["hang"] = None
        except BaseException as exc:
            outcome["hang"] = exc

    thread = threading.Thread(target=hang)
    thread.start()
    wait_for(lambda: len(pool._idle) == 1)  # the hanging job holds one worker
    assert pool.load_image(SEEDS["jpeg"][1], LIMITS).size == (64, 48)  # the other one serves meanwhile
    assert thread.is_alive() and not outcome
    pool.close()  # kills the hanging worker: its caller learns that decoding was shut down
    thread.join()
    assert isinstance(outcome["hang"], EngineDeadError)
    assert not children(pids)


def test_close_reaps_every_worker_and_the_pool_restarts() -> None:
    pool = DecodePool(workers=2, timeout_s=TIMEOUT_S, memory_mib=MEMORY_MIB)
    pool.start()
    pids = set(pool.worker_pids())
    assert len(pids) == 2 and children(pids) == pids
    pool.close()
    assert pool.worker_pids() == [] and not children(pids)
    assert pool.load_image(SEEDS["png"][1], LIMITS).size == (64, 48)  # respawned on demand
    again = set(pool.worker_pids())
    assert len(again) == 1 and not again & pids
    pool.close()
    assert not children(again)


# ------------------------------------------------------------------------------------------ the server


@pytest.mark.parametrize(("case", "kind", "data"), CASES, ids=[c[0] for c in CASES])
def test_mutated_media_get_2xx_or_a_clean_4xx(http: httpx.Client, case: str, kind: str, data: bytes) -> None:
    check_answer(upload(http, data))
    check_answer(chat(http, kind, data))


def test_valid_seeds_are_accepted(http: httpx.Client) -> None:
    for name, (kind, data) in SEEDS.items():
        response = upload(http, data)
        assert response.status_code == 200, (name, response.text)
        assert (response.json()["media_type"], response.json()["width"]) == (kind, 64)
        assert chat(http, kind, data).status_code == 200, name


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("hang", png_with_text(HANG_MARKER), f"could not be decoded within {TIMEOUT_S:g} s (decode_timeout_s)"),
        ("jpeg-scan-bomb", jpeg_scan_bomb(), f"could not be decoded within {TIMEOUT_S:g} s (decode_timeout_s)"),
        ("crash", png_with_text(CRASH_MARKER), "could not be decoded (the decoder failed on this data)"),
        # A real file: 49 M pixels pass the pixel cap, but decoding and converting them needs ~390 MB.
        ("memory", encode_image("PNG", np.zeros((7000, 7000, 3), np.uint8)),
         f"could not be decoded within {MEMORY_MIB} MiB of memory (decode_memory_mib)"),
    ],
)  # fmt: skip
def test_hang_crash_and_memory_cost_one_item_and_a_worker(
    http: httpx.Client, pool: DecodePool, name: str, data: bytes, expected: str
) -> None:
    for send, prefix in ((upload, "file: "), (lambda h, d: chat(h, "image", d), "image 0: ")):
        replaced, seen = pool.num_replaced, set(pool.worker_pids())
        response = send(http, data)
        assert response.status_code == 400, response.text
        assert check_answer(response) == prefix + expected
        assert pool.num_replaced == replaced + 1
        assert not children(seen - set(pool.worker_pids()))  # the failed worker is gone and reaped
        assert upload(http, SEEDS["png"][1]).status_code == 200  # the next item is served
        assert chat(http, "image", SEEDS["png"][1]).status_code == 200


def test_afterwards_the_engine_holds_nothing_and_the_server_is_up(
    http: httpx.Client, engine: AsyncEngine, pool: DecodePool
) -> None:
    assert http.get("/health").status_code == 200
    def idle() -> bool:
        stats = engine.stats()
        return (
            stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
        )

    wait_for(idle)
    report = engine.call_utility("leak_report")  # entries left are the LRU cache, unowned
    assert not any(report.values()), report
    assert 1 <= len(pool.worker_pids()) <= LIMITS.decode_workers


def test_server_shutdown_stops_the_workers(engine: AsyncEngine, settings: ServerSettings) -> None:
    live = ServerThread(lambda: create_app(engine, settings))
    try:
        pool = engine.processor.mm_processor.decoder  # type: ignore[union-attr]
        pids = set(pool.worker_pids())
        assert len(pids) == LIMITS.decode_workers  # started with the server
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}) as client:
            assert upload(client, SEEDS["gif"][1]).status_code == 200
    finally:
        live.stop()
    assert pool.worker_pids() == [] and not children(pids)
