"""`AsyncEngine`: the engine loop on a background thread, one async output stream per request.

Only messages cross into the loop (add, abort, shutdown: all picklable); outputs come back through
the event loop with `call_soon_threadsafe`. Prompt processing (templating, media decoding) runs in
a worker thread of the caller, so a slow image never stalls the step loop or the event loop.

Faults: a request the runner could not build fails alone (`RequestFailedError`); a step that fails
on the device fails the requests it touched; any other step error fails every request in flight.
The engine keeps serving in all three cases. If the loop itself dies, every stream gets
`EngineDeadError` at once, `is_running` turns False and `dead` is set (the server then exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.core import StepRecord
from mmserve.engine.faults import RequestFailedError, StepFault
from mmserve.engine.loader import load_engine
from mmserve.engine.output_processor import OutputProcessor, RequestOutput
from mmserve.engine.processor import Message, PromptType
from mmserve.errors import EngineDeadError, MMServeError
from mmserve.request import Request, RequestStatus, SamplingParams
from mmserve.scheduler.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class QueueFullError(MMServeError):
    """Too many requests are waiting; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StatLogger(Protocol):
    """Receives what the engine loop observes (e.g. the Prometheus exporter). Called on the loop thread."""

    def on_output(self, output: RequestOutput, now: float) -> None: ...

    def on_step(self, stats: SchedulerStats, step: StepRecord | None) -> None: ...


@dataclass(frozen=True)
class _Add:
    request: Request
    prompt: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Shutdown:
    pass


_STREAM_END = object()  # sentinel after a stream's final output
_Batch = list[tuple[asyncio.Queue, Any]]  # (stream, item) pairs for one event loop


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        media_limits: MediaLimits | None = None,
        max_waiting_requests: int = 1024,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        loaded = load_engine(args, media_limits)
        self.args = args
        self.tokenizer, self.processor, self._core = loaded.tokenizer, loaded.processor, loaded.core
        self.max_model_len = loaded.core.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._inbox: queue.Queue[_Add | _Abort | _Shutdown] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending
        self._num_pending = 0  # accepted but not yet seen by the loop
        self._ids = itertools.count()
        self._stats = loaded.core.stats()
        # Emitted but not yet handed over, per consumer event loop, in order (touched by the loop thread only).
        self._outbox: dict[asyncio.AbstractEventLoop, _Batch] = {}
        self._dead: BaseException | None = None
        self.dead = threading.Event()  # set once the loop has died (not on a clean shutdown)
        self.num_failed_requests = 0  # failed by an engine fault (not by their own invalid input)
        self._thread = threading.Thread(target=self._run_loop, name="mmserve-engine", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.args.model

    def stats(self) -> SchedulerStats:
        """The scheduler's counters as of the last step (read without stopping the loop)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        """Running and not draining: new requests are taken."""
        return self.is_running and not self._closing

    @property
    def num_in_flight(self) -> int:
        """Requests with an open output stream (accepted and not yet finished)."""
        with self._lock:
            return len(self._streams)

    def drain(self) -> None:
        """Stop taking new requests (they get `EngineDeadError`, a 503); running ones go on."""
        self._closing = True

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs: each carries the new text/tokens and the totals so far;
        the last has `finish_reason` set. Closing the iterator early aborts the request."""
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_accepting()
        loop = asyncio.get_running_loop()
        request, text = await loop.run_in_executor(None, self.processor.process, prompt, params, request_id)
        stream: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise MMServeError(f"request id {request_id!r} is already in use")
            self._check_accepting()
            self._streams[request_id] = (loop, stream)
            self._num_pending += 1
        self._inbox.put(_Add(request, text))
        finished = False
        try:
            while True:
                item = await stream.get()
                if item is _STREAM_END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free the request
                self._inbox.put(_Abort(request_id))

    async def chat(
        self, messages: Sequence[Message], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        prompt = self.processor.chat_prompt(messages)
        async for output in self.generate(prompt, params, request_id):
            yield output

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to `timeout` s, abort the rest."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.02)
        self._inbox.put(_Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # -- internals -----------------------------------------------------------------------------------
    _closing = False

    def _check_accepting(self) -> None:
        if self._dead is not None or self._closing:
            raise EngineDeadError("the engine is not accepting requests")
        waiting = self._stats.num_waiting + self._num_pending
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are already waiting (max_waiting_requests)", retry_after=1.0
            )

    def _emit(self, request_id: str, item: Any, last: bool) -> None:
        """Queue `item` for the request's stream; `_flush` hands it over (once per loop iteration)."""
        with self._lock:
            entry = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if entry is None:
            return
        loop, stream = entry
        batch = self._outbox.setdefault(loop, [])
        batch.append((stream, item))
        if last and not isinstance(item, BaseException):
            batch.append((stream, _STREAM_END))

    def _flush(self) -> None:
        """One `call_soon_threadsafe` per event loop for everything emitted since the last flush: a
        step's 64 outputs wake the server's loop once, not 64 times (each wake is a self-pipe write and
        a loop iteration, on the cores the next step's forward runs on)."""
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
                loop.call_soon_threadsafe(_deliver, batch)

    def _run_loop(self) -> None:
        core = self._core
        outputs = OutputProcessor(self.tokenizer, core.scheduler_config.class_slo)
        try:
            while True:
                self._flush()
                # Block for messages only when idle; otherwise take what has arrived and step.
                block = not core.has_unfinished_requests()
                while True:
                    try:
                        message = self._inbox.get(block=block, timeout=0.1 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    if isinstance(message, _Shutdown):
                        self._abort_all(core, outputs, EngineDeadError("the engine shut down"))
                        self._flush()
                        return
                    self._handle(message, core, outputs)
                self._flush()  # refusals and aborts' final outputs go out now, not after the next step
                if not core.has_unfinished_requests():
                    continue
                try:
                    core_outputs = core.step()
                except StepFault as fault:  # failed on the device: the requests it touched fail
                    logger.error("engine step failed; failing the requests of that step", exc_info=fault)
                    self._fail_step(core, outputs, fault)
                    continue
                except Exception as exc:  # state unknown: every request in flight fails, not the engine
                    logger.exception("engine step failed; failing the requests in flight")
                    self._abort_all(
                        core, outputs, RequestFailedError("the request failed inside the engine"), exc
                    )
                    continue
                failed, core.runner.last_failed = core.runner.last_failed, []
                for f in failed:  # left out of the step by the runner: they fail alone
                    request = core.scheduler.requests.get(f.request_id)
                    if request is not None and request.status == RequestStatus.RUNNING:
                        # What its KV really holds, so that freeing it unpublishes the blocks never written.
                        request.num_computed_tokens = f.num_computed_tokens
                    self._fail(core, outputs, f.request_id)
                now = time.monotonic()
                updated, stopped = outputs.process(core_outputs)
                for request_id in stopped:
                    core.abort_request(request_id, RequestStatus.FINISHED_STOPPED)
                for out in updated:
                    for stat_logger in self.stat_loggers:
                        stat_logger.on_output(out, now)
                    self._emit(out.request_id, _snapshot(out), out.finished)
                self._stats = core.stats()
                record = core.step_history[-1] if core.step_history else None
                for stat_logger in self.stat_loggers:
                    stat_logger.on_step(self._stats, record)
        except BaseException as exc:  # the loop itself broke: fail everyone, refuse new work
            logger.critical("engine loop died", exc_info=exc)
            self._dead = exc
            # Streams first: cleaning up a broken core may raise again, and nobody may hang.
            with self._lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._emit(request_id, EngineDeadError("the engine loop died"), last=True)
            self._flush()
            self.dead.set()

    def _fail(self, core: Any, outputs: OutputProcessor, request_id: str) -> None:
        """One request failed inside the engine: free everything it holds and end its stream with an error."""
        core.abort_request(request_id)
        self._close_output(outputs, request_id)
        self.num_failed_requests += 1
        self._emit(request_id, RequestFailedError("the request failed inside the engine"), last=True)
        self._stats = core.stats()

    def _close_output(self, outputs: OutputProcessor, request_id: str) -> None:
        """Drop a failed request's output state; stat loggers see it end (as aborted), so none of
        their per-request state outlives it."""
        final = outputs.abort_request(request_id)
        if final is not None:
            now = time.monotonic()
            for stat_logger in self.stat_loggers:
                stat_logger.on_output(final, now)

    def _fail_step(self, core: Any, outputs: OutputProcessor, fault: StepFault) -> None:
        """The core has reset the encoder and prefix caches. Fail the step's requests (their KV for the
        step is indeterminate) and every request part-way into its media (its encoder entries are gone);
        the others keep their KV, which the step never wrote, and go on."""
        victims = set(fault.request_ids)
        for request_id, request in core.scheduler.requests.items():
            media_end = max(
                (m.placeholder.offset + m.placeholder.length for m in request.mm_inputs), default=0
            )
            if 0 < request.num_computed_tokens < media_end:
                victims.add(request_id)
        for request_id in victims:
            self._fail(core, outputs, request_id)

    def _handle(self, message: _Add | _Abort, core: Any, outputs: OutputProcessor) -> None:
        if isinstance(message, _Add):
            with self._lock:
                self._num_pending -= 1
                wanted = message.request.request_id in self._streams
            if not wanted:
                return  # aborted before the loop saw it
            try:
                core.add_request(message.request)
            except MMServeError as exc:
                self._emit(message.request.request_id, exc, last=True)
                return
            outputs.add_request(message.request, message.prompt)
        else:
            core.abort_request(message.request_id)
            final = outputs.abort_request(message.request_id)
            if final is not None:
                now = time.monotonic()
                for stat_logger in self.stat_loggers:
                    stat_logger.on_output(final, now)
                self._emit(message.request_id, _snapshot(final), last=True)
            self._stats = core.stats()

    def _abort_all(
        self, core: Any, outputs: OutputProcessor, error: BaseException, cause: BaseException | None = None
    ) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            request_ids = list(self._streams)
        if isinstance(error, RequestFailedError):
            self.num_failed_requests += len(request_ids)
        for request_id in request_ids:
            core.abort_request(request_id)
            self._close_output(outputs, request_id)
            self._emit(request_id, error, last=True)
        self._stats = core.stats()


def _deliver(batch: _Batch) -> None:
    """On the consumer's event loop: put each item on its stream, in emission order."""
    for stream, item in batch:
        stream.put_nowait(item)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep while the loop goes on updating the original."""
    return RequestOutput(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        token_ids=list(out.token_ids),
        text=out.text,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=list(out.logprobs) if out.logprobs is not None else None,
        metrics=out.metrics,
        new_text=out.new_text,
        new_token_ids=list(out.new_token_ids),
        service_class=out.service_class,
        slo=out.slo,
    )
