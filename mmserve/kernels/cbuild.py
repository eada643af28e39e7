"""Builds mmserve's C kernels (`kernels/csrc/*.c`) once per machine with the system C compiler and loads
them with ctypes. A library is cached under `cache_dir()`, keyed by its source, flags, compiler and the
CPU's feature flags; `CKernel.load()` returns None (with one warning) where nothing can be built, and
each caller then keeps its torch twin."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -march=native: the library is built for, and cached per, the CPU it runs on (see cpu_fingerprint). -fopenmp
# links libgomp, which resolves to the copy torch already loaded where they share the soname (pip wheels):
# the kernel's threads are then torch's own pool, not a second one contending for the same cores.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked in a second step without -ffast-math: linking with it adds GCC's crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process when the library loads (every later torch op would see it).
LDFLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    """Where compiled kernels (and measured choices) live: $MMSERVE_KERNEL_CACHE, else ~/.cache/mmserve/kernels."""
    env = os.environ.get("MMSERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mmserve" / "kernels"


def cpu_fingerprint() -> str:
    """The machine's architecture and CPU feature flags: what a native build or a measurement depends on."""
    cpu = platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu += next(line for line in lines if line.startswith(("flags", "Features")))  # x86, ARM
    except (OSError, StopIteration):
        cpu += platform.processor()
    return cpu


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


class CKernel:
    """One exported function of one C source file, built on first use; thread-safe."""

    def __init__(
        self, source: str, symbol: str, argtypes: list[Any], restype: Any = ctypes.c_int, cflags: tuple[str, ...] = ()
    ) -> None:
        self.source, self.symbol = CSRC / source, symbol
        self.cflags = CFLAGS + cflags  # a later flag overrides an earlier one
        self.argtypes, self.restype = argtypes, restype
        self._lock = threading.Lock()
        self._function: ctypes._CFuncPtr | None = None
        self._failed = False

    def load(self) -> ctypes._CFuncPtr | None:
        """The compiled function, building it on first use; None (with one warning) where no C compiler works."""
        if self._function is not None or self._failed:  # decided: no lock on the per-layer path
            return self._function
        with self._lock:
            if self._function is not None or self._failed:
                return self._function
            compiler = _compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C compiler found (set CC, or install gcc)")
                library = cache_dir() / f"{self.source.stem}-{self._cache_key(compiler)}.so"
                if not library.exists():
                    self._compile(compiler, library)
                function = getattr(ctypes.CDLL(str(library)), self.symbol)
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
                self._failed = True
                log.warning("C kernel %s unavailable, using its torch twin: %s", self.symbol, exc)
                return None
            function.argtypes, function.restype = self.argtypes, self.restype
            self._function = function
            return function

    def _cache_key(self, compiler: str) -> str:
        """Source (and the shared headers), flags, compiler and the CPU's feature flags: a shared home directory on machines with
        different CPUs must never load a library built for another one's instruction set."""
        digest = hashlib.sha256()
        headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # what the sources may include
        for part in (self.source.read_bytes(), *headers, " ".join(self.cflags + LDFLAGS).encode(), compiler.encode()):
            digest.update(part)
        digest.update(cpu_fingerprint().encode())
        return digest.hexdigest()[:16]

    def _compile(self, compiler: str, library: Path) -> None:
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place, so processes compiling at once never load a
        # half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        obj = tmp[: -len(".so")] + ".o"
        try:
            for command in (
                [compiler, *self.cflags, "-c", "-o", obj, str(self.source)],
                [compiler, *LDFLAGS, "-o", tmp, obj, "-lm"],
            ):
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, library)
        finally:
            for path in (tmp, obj):
                if os.path.exists(path):
                    os.unlink(path)
