"""What machine a bench ran on, for its report: the CPU's name, load averages, and the CPU time other work took
while it ran (a shared machine's contention)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo's `model name`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn: Callable[[], T]) -> tuple[float, T, float]:
    """(wall seconds, fn(), this process's CPU seconds over the same span: all its threads)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - start, result, time.process_time() - cpu_start


def cpu_times() -> tuple[float, float, list[int] | None]:
    """(wall clock, CPU seconds of this process and its waited-for children, /proc/stat's cpu line)."""
    t = os.times()
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        stat = [int(x) for x in fields]
    except (OSError, ValueError, IndexError):
        stat = None
    return time.monotonic(), t.user + t.system + t.children_user + t.children_system, stat


def other_cpu(before: tuple, after: tuple) -> dict:
    """CPU time the machine spent outside this benchmark (its process and ranks) while it ran, and the
    time the hypervisor stole: a shared machine's contention, which inflates step times unevenly (a
    two-thread engine waits at every parallel region for a descheduled thread)."""
    wall, mine = after[0] - before[0], after[1] - before[1]
    if before[2] is None or after[2] is None:
        return {"wall_s": wall, "other_cpu_s": None, "steal_s": None}
    hz = os.sysconf("SC_CLK_TCK")
    delta = [b - a for a, b in zip(before[2], after[2], strict=False)]
    busy = sum(delta[i] for i in (0, 1, 2, 5, 6) if i < len(delta)) / hz  # user nice system irq softirq
    steal = delta[7] / hz if len(delta) > 7 else 0.0
    other = max(0.0, busy - mine)
    return {
        "wall_s": wall,
        "other_cpu_s": other,
        "other_cpu_share": other / (wall * (os.cpu_count() or 1)),  # of all the machine's CPU time
        "steal_s": steal,
    }


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: well above the ranks' own threads, other work shared the CPUs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
