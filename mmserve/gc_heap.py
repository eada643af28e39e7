"""Short full garbage collections in a serving process: the start-up heap moved out of the collector's reach.

A full (oldest-generation) collection scans every tracked object. After start-up that is the imported modules,
the model's and the engine's objects: hundreds of thousands, and a scan of them stops the process for
a fifth of a second on these CPUs. CPython runs one whenever enough objects have survived into the oldest
generation. Nothing started then is garbage, so `gc.freeze()` moves it to the permanent generation, which
collections skip: a full collection then scans only what serving allocated (vLLM and SGLang do the same after
start-up). `gc.unfreeze()` puts it back when the scope ends, so an engine closed in a process that goes on
(a test, a notebook) can still be collected.

Knows nothing of the engine: the process entry points (the API server's lifespan, the engine-core process,
a tensor-parallel rank) wrap their serving in `startup_heap_frozen`. The in-process `LLM` does not: a library
call should not freeze its caller's heap, and offline generation does not wait on a token.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0  # scopes open in this process: the heap is unfrozen when the last one ends


@contextmanager
def startup_heap_frozen(what: str) -> Iterator[int]:
    """Collects, then freezes every object alive now; yields how many are frozen. Scopes nest (an API server
    with its engine core in the same process): the heap stays frozen until the outermost one ends."""
    global _depth
    with _lock:
        start = time.perf_counter()
        gc.collect()  # garbage frozen now would stay until the scope ends
        gc.freeze()
        _depth += 1
        frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of full collections (%.0f ms)", what, frozen,
                (time.perf_counter() - start) * 1e3)  # fmt: skip
    try:
        yield frozen
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
