"""Engine faults: the errors that say whom a failed step hurts, and the model runner's fault-injection hook.

A fault raised while preparing one request's inputs (before anything touches the device) is that
request's alone (`RequestFault`); an exception once device work has begun cannot be attributed
(`StepFault`). `FaultInjector` lets tests raise either, or kill the engine loop, on purpose.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Iterable

from mmserve.errors import MMServeError

# `MMSERVE_INJECT_FAULTS="req-a,*-bad"`: request ids (or fnmatch patterns) whose input
# preparation raises. Read once when a runner is built; only for tests of a live `mmserve serve`.
FAULTS_ENV = "MMSERVE_INJECT_FAULTS"


class RequestFailedError(MMServeError):
    """The engine failed this request (its step raised); other requests go on. The API answers 500."""


class InjectedFault(RuntimeError):
    """Raised by `FaultInjector` (tests only)."""


class EngineLoopKilled(BaseException):  # a BaseException on purpose: no `except Exception` contains it
    """Raised by `FaultInjector.kill_loop`: escapes every `except Exception` and ends the engine loop."""


class StepFault(Exception):
    """A batched step raised after device work began; KV writes and encoder outputs of the step are
    indeterminate. `request_ids`: every request the step touched (scheduled tokens or encoder work).

    `ranks_agree`: every tensor-parallel rank raised it at the same point of the step (a plan that
    contradicts the earlier ones, an injected fault, media that failed to encode on some rank), so the
    ranks are still in lockstep and the engine can go on. Always true with one rank."""

    def __init__(self, request_ids: frozenset[str], cause: BaseException, ranks_agree: bool = True) -> None:
        super().__init__(f"a step over {len(request_ids)} requests failed: {type(cause).__name__}")
        self.request_ids = request_ids
        self.ranks_agree = ranks_agree
        self.__cause__ = cause


class EncoderFailed(RuntimeError):
    """Some rank failed to encode its share of a step's media; raised on every rank after the
    embeddings' all-gather (which carries each rank's status), so all of them fail the step alike."""


class EngineFatalError(Exception):
    """The engine cannot go on: a tensor-parallel rank died, hung past the collective timeout, or failed
    where the ranks may have left lockstep. The engine core lets it escape; its process exits non-zero."""


class FaultInjector:
    """Test hook read by the model runner on every step. Thread-safe: tests arm it from another thread.

    - `fail_requests(ids)`: preparing those requests' inputs raises (an attributable, per-request fault).
      Ids are fnmatch patterns: "*-bad" matches every request id ending in "-bad".
    - `fail_next_step()`: the next batched forward raises (an unattributable fault).
    - `kill_loop()`: the next step raises `EngineLoopKilled`, which ends the engine loop itself.
    - `fail_encode(ranks)`: the next media encode on those tensor-parallel ranks raises (a fault on
      some ranks only; every rank learns of it from the embeddings' all-gather).
    """

    def __init__(self, request_ids: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._request_ids: set[str] = set(request_ids)
        self._fail_step = False
        self._kill = False
        self._fail_encode_ranks: set[int] = set()

    @classmethod
    def from_env(cls) -> FaultInjector:
        raw = os.environ.get(FAULTS_ENV, "")
        return cls(part.strip() for part in raw.split(",") if part.strip())

    def fail_requests(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._request_ids.update(request_ids)

    def fail_next_step(self) -> None:
        with self._lock:
            self._fail_step = True

    def kill_loop(self) -> None:
        with self._lock:
            self._kill = True

    def fail_encode(self, ranks: Iterable[int]) -> None:
        with self._lock:
            self._fail_encode_ranks.update(ranks)

    def clear(self) -> None:
        with self._lock:
            self._request_ids.clear()
            self._fail_encode_ranks.clear()
            self._fail_step = self._kill = False

    def apply(self, action: str, request_ids: Iterable[str] = ()) -> None:
        """One of the calls above by name (what crosses processes): "fail_requests" | "fail_next_step"
        | "kill_loop" | "fail_encode" (`request_ids` holds the ranks) | "clear"."""
        if action == "fail_requests":
            self.fail_requests(request_ids)
        elif action == "fail_next_step":
            self.fail_next_step()
        elif action == "kill_loop":
            self.kill_loop()
        elif action == "fail_encode":
            self.fail_encode(int(rank) for rank in request_ids)  # the ranks, as strings
        elif action == "clear":
            self.clear()
        else:
            raise ValueError(f"unknown fault action {action!r}")

    # -- called by the model runner ------------------------------------------------------------------
    def check_request(self, request_id: str) -> None:
        with self._lock:
            hit = any(fnmatch.fnmatchcase(request_id, p) for p in self._request_ids)
        if hit:
            raise InjectedFault(f"injected fault for request {request_id}")

    def check_encode(self, rank: int) -> None:
        with self._lock:
            hit = rank in self._fail_encode_ranks
            self._fail_encode_ranks.discard(rank)
        if hit:
            raise InjectedFault(f"injected fault in rank {rank}'s media encode")

    def check_step(self) -> None:
        with self._lock:
            kill, fail, self._kill, self._fail_step = self._kill, self._fail_step, False, False
        if kill:
            raise EngineLoopKilled("injected: the engine loop is killed")
        if fail:
            raise InjectedFault("injected fault in the batched forward")
