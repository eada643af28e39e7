"""`AsyncEngine`: the front end of a served engine — one async output stream per request.

The engine core runs in its own process (the default) or on a thread (`engine_process=False`); either
way only typed messages cross to it (`core_client.EngineCoreClient`). This side keeps templating,
tokenizing and media decoding (in a worker thread of the caller, so a slow image never stalls the
event loop), and detokenizing and stop strings (a stop string becomes an abort message down).

An output thread receives each step's outputs, detokenizes them and hands them to each consumer event
loop in one `call_soon_threadsafe` (a 64-stream step wakes the server's loop once, not 64 times).

Faults: a request the engine failed ends its stream with `RequestFailedError`; the others go on. If the
core dies (its process is killed, or its loop escapes), every stream gets `EngineDeadError` at once,
`is_running` turns False and `dead` is set (the server then exits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import msgspec

from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.core_client import CoreHandle, EngineCoreClient
from mmserve.engine.faults import RequestFailedError
from mmserve.engine.loader import load_frontend, resolve_checkpoint
from mmserve.engine.messages import EngineCoreOutputs, EngineInfo
from mmserve.engine.output_processor import OutputProcessor, RequestOutput
from mmserve.engine.processor import Message, PromptType
from mmserve.engine.wire import CoreDead, RequestRejected, StepOutputs, UtilityResult
from mmserve.errors import EngineDeadError, InvalidRequestError, MMServeError, PromptTooLongError
from mmserve.request import SamplingParams
from mmserve.scheduler.scheduler import SchedulerStats
from mmserve.scheduler.slo import SloInfeasibleError

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the output thread checks that the core is alive while no message comes
# Errors the core reports by name when it refuses a request, rebuilt here.
_REJECTIONS: dict[str, type[MMServeError]] = {
    cls.__name__: cls
    for cls in (InvalidRequestError, PromptTooLongError, SloInfeasibleError, RequestFailedError, MMServeError)
}
_UTILITY_TYPES: dict[str, Any] = {"stats": SchedulerStats, "info": EngineInfo}


class QueueFullError(MMServeError):
    """Too many requests are waiting; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StatLogger(Protocol):
    """Receives what the engine emits (e.g. the Prometheus exporter). Called on the output thread."""

    def on_output(self, output: RequestOutput, now: float) -> None: ...

    def on_step(self, outputs: EngineCoreOutputs) -> None:
        """Every step's outputs, after `on_output` for each request (stats, step record, loop times)."""
        ...


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
        engine_process: bool = True,
        core: CoreHandle | None = None,
        client_index: int = 0,
    ) -> None:
        """`core`: serve through that running engine core (one of `--api-server-count` front ends,
        number `client_index`) instead of starting one."""
        args = resolve_checkpoint(args)  # a bad model path fails here, before any process starts
        self.args = args
        self._client = EngineCoreClient(args, engine_process=engine_process, client_index=client_index, core=core)
        self.info: EngineInfo = self._client.info
        try:
            self.tokenizer, self.processor = load_frontend(args, self.info.max_model_len, media_limits)
        except BaseException:
            self._client.close()
            raise
        self.max_model_len = self.info.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._outputs = OutputProcessor(self.tokenizer, self.info.scheduler_config.class_slo)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._forks: dict[str, list[str]] = {}  # n > 1: request id -> its other sequences' ids
        # Guards _streams, _outputs and _num_pending (the output thread and the callers' threads).
        self._lock = threading.Lock()
        self._num_pending = 0  # sent to the core, not yet counted by its stats
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[str, concurrent.futures.Future]] = {}
        self._stats = self._client_stats_at_start()
        # Emitted but not yet handed over, per consumer event loop, in order (output thread only).
        self._outbox: dict[asyncio.AbstractEventLoop, _Batch] = {}
        self._dead: BaseException | None = None
        self._closing = False
        self._stopped = False
        self.dead = threading.Event()  # set once the core has died (not on a clean shutdown)
        self.num_failed_requests = 0  # failed by an engine fault (not by their own invalid input)
        self._thread = threading.Thread(target=self._run_output_loop, name="mmserve-outputs", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.args.model

    @property
    def engine_process_pid(self) -> int | None:
        """The engine core's process id (None when it runs on a thread of this process)."""
        return self._client.core_pid

    def stats(self) -> SchedulerStats:
        """The scheduler's counters as of the core's last message (read without a round trip)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopped and self._thread.is_alive()

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
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs: each carries the new text/tokens and the totals so far;
        the last has `finish_reason` set. Closing the iterator early aborts the request.
        `arrival_time` (time.monotonic()): when the server received it; TTFT counts from there.
        With `params.n > 1` the outputs of the n sequences come interleaved, each with its `index`
        (and totals of its own sequence); the stream ends once all n have finished."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_accepting()
        loop = asyncio.get_running_loop()
        request, text = await loop.run_in_executor(
            None, self.processor.process, prompt, params, request_id, arrival_time
        )
        requests = request.forks()  # [request] unless n > 1
        stream: asyncio.Queue[Any] = asyncio.Queue()  # one queue for all n sequences
        with self._lock:
            if any(r.request_id in self._streams for r in requests):
                raise MMServeError(f"request id {request_id!r} is already in use")
            self._check_accepting()
            now = time.monotonic()
            for index, r in enumerate(requests):
                self._streams[r.request_id] = (loop, stream)
                self._outputs.add_request(r, text, now, index)
            if len(requests) > 1:
                self._forks[request_id] = [r.request_id for r in requests[1:]]
            self._num_pending += len(requests)
        num_open = len(requests)
        try:
            for r in requests:
                self._client.add_request(r)
            while num_open:
                item = await stream.get()
                if item is _STREAM_END:
                    num_open -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # Consumer gone (disconnect, cancel), or one sequence failed: free what is still running.
            # (Finished ones are no-ops for abort.)
            self.abort(request_id)

    async def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
        **template: Any,
    ) -> AsyncIterator[RequestOutput]:
        """`template`: the chat template's options (`Processor.chat_prompt`: tools, add_generation_prompt,
        continue_final_message, chat_template, chat_template_kwargs)."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        prompt = self.processor.chat_prompt(messages, **template)
        async for output in self.generate(prompt, params, request_id, arrival_time=arrival_time):
            yield output

    def abort(self, request_id: str, stop_reason: str | None = None) -> None:
        """End a request: the core frees it, and its stream (if still read) gets a final output with
        finish_reason "abort" (and `stop_reason`, e.g. "shutdown")."""
        with self._lock:
            final = self._outputs.abort_request(request_id)
            entry = self._streams.pop(request_id, None)
            forks = self._forks.pop(request_id, [])
        for fork_id in forks:  # the request's other sequences (n > 1)
            self.abort(fork_id, stop_reason)
        if entry is None and final is None:
            return
        with contextlib.suppress(Exception):  # the core may be gone already: nothing to free there
            self._client.abort_requests([request_id])
        if final is not None:
            final.stop_reason = stop_reason
            now = time.monotonic()
            for stat_logger in self.stat_loggers:
                stat_logger.on_output(final, now)
            if entry is not None:
                loop, stream = entry
                with self._lock:  # after anything the output thread queued for it, in order
                    self._outbox.setdefault(loop, []).extend([(stream, _snapshot(final)), (stream, _STREAM_END)])
                self._flush()

    def abort_all(self, stop_reason: str) -> int:
        """Abort every request in flight (the end of a drain); returns how many."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id, stop_reason)
        return len(request_ids)

    def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call an engine-core utility (`EngineCore.UTILITIES`) and wait for its result, from any thread
        but the output thread."""
        return self.utility_future(method, *args).result(timeout)

    async def acall_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self.utility_future(method, *args)), timeout)

    def utility_future(self, method: str, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            if not self.is_running:
                future.set_exception(EngineDeadError("the engine is not running"))
                return future
            self._calls[call_id] = (method, future)
        self._client.call_utility(call_id, method, args)
        return future

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to `timeout` s, abort the rest."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Fail what is still open, stop the core and the output thread (idempotent)."""
        self._closing = True
        if self._stopped:
            return
        self._stopped = True
        self._thread.join(5)
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._outputs.abort_request(request_id)
            self._emit(request_id, EngineDeadError("the engine shut down"), last=True)
        self._flush()
        with self._lock:
            calls, self._calls = self._calls, {}
        for _, future in calls.values():
            future.set_exception(EngineDeadError("the engine shut down"))
        self._client.close()

    # -- internals -----------------------------------------------------------------------------------
    def _client_stats_at_start(self) -> SchedulerStats:
        total = self.info.num_kv_blocks
        return SchedulerStats(total, total, 0, 0, 0, 0, 0, 0, 0, 0)

    def _check_accepting(self) -> None:
        if self._dead is not None or self._closing or self._stopped:
            raise EngineDeadError("the engine is not accepting requests")
        waiting = self._stats.num_waiting + self._num_pending
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are already waiting (max_waiting_requests)", retry_after=1.0
            )

    def _emit(self, request_id: str, item: Any, last: bool) -> None:
        """Queue `item` for the request's stream; `_flush` hands it over (once per message)."""
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
        """One `call_soon_threadsafe` per event loop for everything emitted since the last flush."""
        with self._lock:  # swapped and scheduled under one lock: two threads' batches keep their order
            outbox, self._outbox = self._outbox, {}
            for loop, batch in outbox.items():
                with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
                    loop.call_soon_threadsafe(_deliver, batch)

    def _run_output_loop(self) -> None:
        client = self._client
        try:
            while not self._stopped:
                message = client.recv(_POLL_S)
                if message is None:
                    if not client.core_alive() and not self._stopped:
                        raise EngineDeadError("the engine core process died")
                    continue
                if isinstance(message, StepOutputs):
                    self._on_step(message.outputs)
                elif isinstance(message, RequestRejected):
                    self._on_rejected(message)
                elif isinstance(message, UtilityResult):
                    self._on_utility(message)
                elif isinstance(message, CoreDead):
                    raise EngineDeadError(f"the engine core's loop died ({message.reason})")
                self._flush()
        except BaseException as exc:  # the core died, or this loop broke: fail everyone, refuse new work
            if self._stopped:
                return
            logger.critical("the engine core is gone: failing every request in flight", exc_info=exc)
            self._dead = exc
            with self._lock:
                request_ids = list(self._streams)
                calls, self._calls = self._calls, {}
            for request_id in request_ids:
                self._emit(request_id, EngineDeadError("the engine died"), last=True)
            self._flush()
            for _, future in calls.values():
                future.set_exception(EngineDeadError("the engine died"))
            self.dead.set()

    def _on_step(self, step: EngineCoreOutputs) -> None:
        now = time.monotonic()
        failed = [o for o in step.outputs if o.error is not None]
        with self._lock:
            self._stats = step.stats
            self._num_pending = 0  # the core has seen every request sent before this step
            finals = [self._outputs.abort_request(o.request_id) for o in failed]
            processed, stopped = self._outputs.process([o for o in step.outputs if o.error is None])
            # Copies taken under the lock: abort() on another thread may end the same output next.
            updated = [_snapshot(out) for out in processed]
        if stopped:
            self._client.abort_requests(stopped, stopped=True)
        for out, final in zip(failed, finals, strict=True):
            self.num_failed_requests += 1
            logger.error("request %s failed in the engine: %s", out.request_id, out.error)
            if final is not None:
                for stat_logger in self.stat_loggers:
                    stat_logger.on_output(final, now)
            self._emit(out.request_id, RequestFailedError("the request failed inside the engine"), last=True)
        for out in updated:
            for stat_logger in self.stat_loggers:
                stat_logger.on_output(out, now)
            self._emit(out.request_id, out, out.finished)
        for stat_logger in self.stat_loggers:
            stat_logger.on_step(step)

    def _on_rejected(self, message: RequestRejected) -> None:
        with self._lock:
            self._outputs.abort_request(message.request_id)
            self._num_pending = max(0, self._num_pending - 1)  # an idle core sends no step to reset it
        cls = _REJECTIONS.get(message.error_type)
        if cls is None:  # not one of ours: its text is the engine's, never shown to clients
            logger.error("request %s rejected by the engine: %s", message.request_id, message.message)
            error: BaseException = RequestFailedError("the request failed inside the engine")
        elif issubclass(cls, InvalidRequestError):
            error = cls(message.message, param=message.param)
        elif cls is SloInfeasibleError:
            error = SloInfeasibleError(message.message, retry_after_s=message.retry_after_s)
        else:
            error = cls(message.message)
        self._emit(message.request_id, error, last=True)

    def _on_utility(self, message: UtilityResult) -> None:
        with self._lock:
            method, future = self._calls.pop(message.call_id, ("", None))
        if future is None:
            return
        if message.error is not None:
            future.set_exception(MMServeError(message.error))
            return
        result = message.result
        if method in _UTILITY_TYPES and result is not None:
            result = msgspec.convert(result, _UTILITY_TYPES[method])
        future.set_result(result)


def _deliver(batch: _Batch) -> None:
    """On the consumer's event loop: put each item on its stream, in emission order."""
    for stream, item in batch:
        stream.put_nowait(item)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep while the output thread goes on updating the original (every field; the
    lists it extends are copied). Copied field by field through `__dict__`, not with `dataclasses.replace`,
    which runs the generated `__init__` with every field by keyword (this runs once a token per stream)."""
    copy = object.__new__(RequestOutput)
    fields = copy.__dict__
    fields.update(out.__dict__)
    fields["token_ids"] = list(out.token_ids)
    fields["new_token_ids"] = list(out.new_token_ids)
    if out.logprobs is not None:
        fields["logprobs"] = list(out.logprobs)
    return copy
