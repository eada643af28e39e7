"""The start-up heap frozen out of full collections while a server serves, and given back after."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import httpx

from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine
from mmserve.gc_heap import startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _tracked(obj: object) -> bool:
    """Whether a collection would scan `obj` (the frozen generation is not in `gc.get_objects()`)."""
    return any(o is obj for o in gc.get_objects())


def test_live_objects_are_frozen_garbage_is_collected_first_and_scopes_nest() -> None:
    assert gc.get_freeze_count() == 0
    live = [object()]
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage
    with startup_heap_frozen("outer") as frozen:
        assert dead() is None  # collected before the freeze, not kept frozen
        assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects freed by refcount leave the count)
        assert not _tracked(live)
        made_while_serving = [object()]
        assert _tracked(made_while_serving)
        with startup_heap_frozen("inner"):
            assert not _tracked(made_while_serving)
        assert gc.get_freeze_count() > 0  # the outer scope still serves
        assert not _tracked(live)
    assert gc.get_freeze_count() == 0
    assert _tracked(live) and _tracked(made_while_serving)


def test_the_api_server_serves_with_its_start_up_heap_frozen(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    engine = AsyncEngine(EngineArgs(str(tiny_model_dir("qwen2")), max_model_len=256, num_kv_blocks=64))
    before_start = [object()]
    live = ServerThread(lambda: create_app(engine, ServerSettings(data_dir=tmp_path, served_model_name="tiny")))
    try:
        assert gc.get_freeze_count() > 0
        assert not _tracked(before_start)
        reply = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        live.stop()
        asyncio.run(engine.shutdown(1.0))
    assert gc.get_freeze_count() == 0  # an app stopped in a process that goes on: its objects collectable again
    assert _tracked(before_start)
