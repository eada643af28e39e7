"""The web chat page (`/`, mmserve/api/static) in a real headless Chromium (Debian's `chromium`, driven by
Playwright) against the REAL server: uvicorn on a free port, `create_app` over an `AsyncEngine` on the tiny
Qwen2-VL checkpoint. Writes docs/screenshot.png when missing or MMSERVE_WRITE_SCREENSHOT=1. Skipped when the system Chromium or playwright is missing.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("the system Chromium is not installed (apt-get install chromium; .ci/run does it)",
                allow_module_level=True)  # fmt: skip
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)

from mmserve.api.app import create_app  # noqa: E402
from mmserve.api.server import ServerThread  # noqa: E402
from mmserve.api.settings import ServerSettings  # noqa: E402
from mmserve.config import EngineArgs  # noqa: E402
from mmserve.engine.async_engine import AsyncEngine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"
IMAGE_CAP = 100_000  # bytes: assets/sample.jpg (~48 KB) fits, the noise PNG below does not
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]  # fmt: skip
DONE = ".msg.assistant[data-status]"
KEY = "sk-web"


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    engine = AsyncEngine(
        EngineArgs(
            str(tiny_model_dir("qwen2_vl")), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256
        )
    )
    settings = ServerSettings(
        data_dir=tmp_path_factory.mktemp("web-data"),
        served_model_name="tiny",
        max_image_upload_bytes=IMAGE_CAP,
    )
    srv = ServerThread(lambda: create_app(engine, settings))
    srv.keyed = ServerThread(lambda: create_app(engine, settings.model_copy(update={"api_key": KEY})))
    yield srv
    srv.keyed.stop()
    srv.stop()
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: ServerThread) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    pg.dialogs = []  # type: ignore[attr-defined]
    pg.console_errors = []  # type: ignore[attr-defined]
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    # Console errors but HTTP statuses (an upload over the cap is a 413 on purpose): CSP refusals, exceptions.
    pg.on("console", lambda m: m.type == "error" and not m.text.startswith("Failed to load resource")
          and pg.console_errors.append(m.text))  # fmt: skip
    pg.on("pageerror", lambda e: pg.console_errors.append(str(e)))
    pg.goto(server.url + "/")
    sync_api.expect(pg.locator("#status")).to_have_attribute("data-state", "connected")
    yield pg
    assert pg.console_errors == []  # no CSP violation, no script error
    context.close()


def configure(page: Any, **values: Any) -> None:
    page.click("#settings summary")
    for name, value in values.items():
        page.fill(f"#set-{name.replace('_', '-')}", str(value))
    page.click("#settings summary")


def chat(page: Any, text: str) -> Any:
    """Send `text`; return the finished reply's locator."""
    n = page.locator(DONE).count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    # A reply waits on the engine, not the page: the UI's 5 s default is too short for a slow machine's generation.
    # (No wait_for_function: the CSP forbids eval.)
    sync_api.expect(page.locator(DONE)).to_have_count(n + 1, timeout=60_000)
    return page.locator(DONE).nth(n)


def http_greedy(server: ServerThread, messages: list[dict[str, Any]], max_tokens: int) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    res = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    res.raise_for_status()
    return res.json()["choices"][0]["message"]["content"]


def running(server: ServerThread) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^mmserve:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_page_headers_and_no_inline_code(server: ServerThread) -> None:
    res = httpx.get(server.url + "/")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/html")
    csp = res.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert re.search(r"<script(?![^>]*\bsrc=)", res.text) is None and "style=" not in res.text
    assert httpx.get(server.url + "/static/app.js").headers["content-security-policy"] == csp
    assert httpx.get(server.url + "/static/..%2Fpage.py").status_code == 404
    assert httpx.get(server.url + "/static/nope.js").status_code == 404


def test_streamed_reply_equals_http_greedy(page: Any, server: ServerThread) -> None:
    system = "You are a terse assistant."
    configure(page, system=system, temperature=0, top_p=1, max_tokens=12)
    user = "Describe a red circle on a white background."
    page.fill("#input", user)
    page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").first
    # A 12-token reply may finish before its transient "streaming" state can be seen;
    # test_stop_mid_stream checks that state on a long reply.
    sync_api.expect(page.locator(DONE)).to_have_count(1)
    first = reply.get_attribute("data-raw")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    assert first == http_greedy(server, messages, 12) and first
    meta = reply.locator(".meta").inner_text()
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ prompt \+ \d+ completion tokens", meta), meta
    # The second turn carries the history (system, user, assistant, user).
    second = chat(page, "And a blue square?").get_attribute("data-raw")
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And a blue square?"}]
    assert second == http_greedy(server, messages, 12)
    # Shift+Enter breaks the line instead of sending.
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#input") == "line one\nline two"
    assert page.locator(DONE).count() == 2


def test_image_and_video_attachments(page: Any, server: ServerThread) -> None:
    configure(page, temperature=0, max_tokens=24)
    page.set_input_files("#file-input", [str(ASSETS / "sample.jpg"), str(ASSETS / "sample_clip.mp4")])
    sync_api.expect(page.locator("#pending .att[data-state=ready]")).to_have_count(2)
    sync_api.expect(page.locator("#pending img.thumb")).to_be_visible()
    sync_api.expect(page.locator("#pending canvas.thumb[data-poster]")).to_be_visible()
    reply = chat(page, "What do the photo and the clip show?")
    assert reply.get_attribute("data-status") in ("completed", "incomplete")
    assert reply.get_attribute("data-raw")
    user = page.locator(".msg.user").last
    sync_api.expect(user.locator("img.thumb")).to_be_visible()
    sync_api.expect(user.locator("canvas.thumb")).to_be_visible()
    sync_api.expect(page.locator("#pending .att")).to_have_count(0)
    page.locator("#input").blur()
    # The committed screenshot is refreshed on request only, so a test run leaves the tree clean.
    shot = ROOT / "docs" / "screenshot.png"
    if os.environ.get("MMSERVE_WRITE_SCREENSHOT") or not shot.exists():
        page.screenshot(path=str(shot))
    else:
        assert len(page.screenshot()) > 10_000  # the page rendered something


def test_stop_mid_stream(page: Any, server: ServerThread) -> None:
    configure(page, temperature=0, max_tokens=1800)
    for how in ("button", "escape"):
        # A fresh conversation each round: the greedy reply then does not depend on where the last
        # round's stop cut its reply (a history that led to an early EOS made this test flaky).
        page.click("#new-chat")
        n = page.locator(".msg.assistant").count()
        page.fill("#input", "Write a very long story.")
        page.press("#input", "Enter")
        reply = page.locator(".msg.assistant").nth(n)
        sync_api.expect(reply.locator(".body")).to_have_text(re.compile(r"\S"))  # deltas are arriving
        sync_api.expect(reply).to_have_class(re.compile("streaming"))  # rendered while it streams
        if how == "button":
            page.click("#stop")
        else:
            page.keyboard.press("Escape")
        sync_api.expect(reply).to_have_attribute("data-status", "cancelled")
        sync_api.expect(reply.locator(".tag")).to_have_text("stopped")
        deadline = time.monotonic() + 10
        while running(server) != 0:
            assert time.monotonic() < deadline, "the stopped request is still running"
            time.sleep(0.1)
        sync_api.expect(page.locator("#send")).to_be_visible()


def test_user_html_is_text(page: Any, server: ServerThread) -> None:
    configure(page, max_tokens=2)
    evil = "<img src=x onerror=alert(1)> and <script>alert(1)</script> **bold** [site](https://example.com)"
    chat(page, evil)
    user = page.locator(".msg.user .body").last
    text = user.inner_text()
    assert "<img src=x onerror=alert(1)>" in text and "<script>alert(1)</script>" in text
    assert user.locator("img, script").count() == 0
    assert user.locator("strong").inner_text() == "bold"
    assert user.locator("a").get_attribute("rel") == "noopener noreferrer"
    # Model text goes through the same renderer: fenced code and lists become elements, HTML stays text.
    html = page.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/static/markdown.js');
            const d = document.createElement('div');
            renderMarkdown('Hi *there*\\n\\n- one <b>x</b>\\n- two\\n\\n```py\\n<script>1</script>\\n```', d);
            return d.innerHTML;
        }"""
    )
    assert html == (
        "<p>Hi <em>there</em></p><ul><li>one &lt;b&gt;x&lt;/b&gt;</li><li>two</li></ul>"
        "<pre><code>&lt;script&gt;1&lt;/script&gt;</code></pre>"
    )
    page.wait_for_timeout(200)
    assert page.dialogs == []


def test_oversized_upload_shows_server_error(page: Any, server: ServerThread, tmp_path: Path) -> None:
    big = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)).save(big)
    assert big.stat().st_size > IMAGE_CAP
    expected = httpx.post(server.url + "/v1/files", files={"file": ("noise.png", big.read_bytes())})
    assert expected.status_code == 413
    page.set_input_files("#file-input", str(big))
    error = page.locator("#pending .att[data-state=error] .error")
    sync_api.expect(error).to_have_text("Not attached: " + expected.json()["error"]["message"])
    sync_api.expect(page.locator("#pending .att .thumb")).to_have_count(0)  # the error, not a thumbnail


def test_rejected_upload_shows_an_error_and_no_broken_thumbnail(
    page: Any, server: ServerThread, tmp_path: Path
) -> None:
    # Named like an image but text: the browser cannot show it, the server refuses it.
    configure(page, max_tokens=4)  # the page's default of 512 sampled tokens took over 5 s on a slow CI machine
    fake = tmp_path / "notes.png"
    fake.write_bytes(b"these are my notes, not a picture\n" * 20)
    expected = httpx.post(
        server.url + "/v1/files", files={"file": ("notes.png", fake.read_bytes(), "image/png")}
    )
    assert expected.status_code == 415  # unsupported_media_type: not an image or video by its content
    page.set_input_files("#file-input", str(fake))
    att = page.locator("#pending .att[data-state=error]")
    sync_api.expect(att.locator(".error")).to_have_text(
        "Not attached: " + expected.json()["error"]["message"]
    )
    sync_api.expect(att.locator(".error")).to_be_visible()
    sync_api.expect(att.locator("img, canvas")).to_have_count(0)  # no broken-image icon
    sync_api.expect(page.locator("#send")).to_be_enabled()  # a failed attachment does not block sending
    reply = chat(page, "hi")
    assert reply.get_attribute("data-status") in ("completed", "incomplete")
    sync_api.expect(page.locator(".msg.user").last.locator(".thumb")).to_have_count(0)


def test_square_image_thumbnail_is_not_cropped(page: Any, server: ServerThread) -> None:
    # easy-vqa test image 2: a small blue triangle near the bottom edge of a 64x64 square. In the 120x90 tile,
    # `object-fit: cover` scaled it to 120x120 and cut 15 px off the bottom, and the triangle's base with it.
    page.set_input_files("#file-input", str(ASSETS / "easy-vqa-test-2.png"))
    thumb = page.locator("#pending .att[data-state=ready] img.thumb")
    sync_api.expect(thumb).to_be_visible()
    assert thumb.evaluate("el => getComputedStyle(el).objectFit") == "contain"
    assert thumb.evaluate("el => el.complete && el.naturalWidth") == 64
    shot = np.asarray(Image.open(io.BytesIO(thumb.screenshot())).convert("RGB")).astype(int)
    blue = (shot[..., 2] > 150) & (shot[..., 0] < 100) & (shot[..., 1] < 100)
    rows = np.nonzero(blue.any(axis=1))[0]
    assert len(rows), "the triangle is not in the thumbnail"
    height = shot.shape[0]
    # Contained, the square is height x height and the triangle (rows 52-60 of 64) ends above the bottom edge.
    assert rows.max() < height - 2, (rows.min(), rows.max(), height)
    expected_rows = (60 - 52 + 1) * height / 64
    assert abs(len(rows) - expected_rows) <= 3, (len(rows), expected_rows)


def test_reconnects_after_server_restart(page: Any, server: ServerThread) -> None:
    configure(page, max_tokens=4)
    server.stop()
    sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "reconnecting")
    sync_api.expect(page.locator("#status")).to_contain_text("retrying")
    server.start()  # the same port, a fresh app over the same engine
    sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "connected", timeout=15_000)
    # Retries while the server was down were refused: expected here, and the only console errors allowed.
    page.console_errors[:] = [e for e in page.console_errors if "ERR_CONNECTION_REFUSED" not in e]
    assert chat(page, "Hello again").get_attribute("data-status") in ("completed", "incomplete")


def test_api_key_from_settings(browser: Any, server: ServerThread) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(server.keyed.url + "/")  # the page itself is public
    sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "reconnecting")
    page.click("#settings summary")
    page.fill("#set-api-key", KEY)
    page.press("#set-api-key", "Enter")  # commits the field ("change"): reconnect with ?api_key=
    sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "connected")
    sync_api.expect(page.locator("#model")).to_have_text("tiny")
    page.fill("#set-max-tokens", "4")
    page.set_input_files("#file-input", str(ASSETS / "sample.jpg"))  # Authorization: Bearer on the upload
    sync_api.expect(page.locator("#pending .att[data-state=ready]")).to_have_count(1)
    assert chat(page, "What is this?").get_attribute("data-status") in ("completed", "incomplete")
    page.reload()  # the key stays in localStorage
    sync_api.expect(page.locator("#status")).to_have_attribute("data-state", "connected")
    context.close()
