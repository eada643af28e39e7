"""Constrained decoding with llguidance: a request's `StructuredOutputs` becomes a grammar, checked in the
front end (`check`) and matched in the engine core (`StructuredOutputManager`): grammars compile on a thread
pool (one compiled matcher per distinct constraint, copied per request), each step gets one token bitmask
for its constrained rows, and each matcher advances on the tokens its request samples.

Knows token ids and the tokenizer's vocabulary (llguidance needs every token's bytes), never request text.
Preemption needs no rollback here: a preempted request keeps its output tokens, and so its matcher state.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from mmserve.engine.sampler import GrammarBitmask
from mmserve.errors import InvalidRequestError
from mmserve.request import Request, StructuredOutputs
from mmserve.scheduler.output import EngineCoreOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Compact JSON as OpenAI writes it: one space after ':' and ','; no other whitespace, so a model cannot
# pad the output with whitespace until max_tokens (random weights would).
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_MAX_CACHED_GRAMMARS = 256


def _signed32(value: int) -> int:
    """An unsigned 32-bit pattern as the int32 that holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint. Raises InvalidRequestError for text it cannot read."""
    kind, _ = spec.key
    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        text = spec.grammar or ""
        return llguidance.grammar_from("gbnf" if "::=" in text else "lark", text)
    except (ValueError, TypeError) as exc:
        raise _invalid(kind, str(exc)) from exc


@functools.lru_cache(maxsize=_MAX_CACHED_GRAMMARS)
def _check_key(key: tuple[str, str], spec: StructuredOutputs) -> None:
    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    if error:
        raise _invalid(key[0], error)


def check(spec: StructuredOutputs | None) -> None:
    """Raises InvalidRequestError (a 400) naming the problem if the grammar library cannot compile the
    constraint. Cheap (no tokenizer needed) and cached per constraint."""
    if spec is not None:
        _check_key(spec.key, spec)


def _invalid(kind: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"structured_outputs.{kind}: the grammar library cannot compile it: {message.strip()}",
        param=f"structured_outputs.{kind}",
    )


@dataclass(frozen=True)
class GrammarFailure:
    """A request whose grammar failed in the core (it passed the front end's check, so not expected)."""

    request_id: str
    message: str


class StructuredOutputManager:
    """The core's grammar state: compiling matchers, one live matcher per constrained request."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int], max_workers: int = 2) -> None:
        """`vocab_size`: the model's (logits) width, which may exceed the tokenizer's."""
        self._model_dir = str(model_dir)
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="mmserve-grammar")
        self._lock = threading.Lock()  # guards the tokenizer and the compiled cache (pool threads)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[llguidance.LLMatcher]] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._ignore_eos: set[str] = set()  # live requests that asked not to stop at EOS

    # -- requests in and out ---------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; it is `ready()` once compiled."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        self._pending[request.request_id] = self._pool.submit(self._new_matcher, spec)
        if request.sampling_params.ignore_eos:
            self._ignore_eos.add(request.request_id)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Block until some pending grammar is compiled, at most `timeout_s` (for an otherwise idle step)."""
        if self._pending:
            concurrent.futures.wait(self._pending.values(), timeout_s, concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[str], list[GrammarFailure]]:
        """(requests whose matcher is now live, requests whose grammar failed to compile)."""
        ready, failed = [], []
        for request_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                self._matchers[request_id] = future.result()
                ready.append(request_id)
            except Exception as exc:  # checked in the front end already: a library or tokenizer fault
                logger.exception("grammar of request %s failed to compile", request_id)
                failed.append(GrammarFailure(request_id, f"the grammar failed to compile: {exc}"))
        return ready, failed

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests (a pending compile is cancelled or discarded)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._ignore_eos.discard(request_id)
            future = self._pending.pop(request_id, None)
            if future is not None:
                future.cancel()

    def request_ids(self) -> list[str]:
        """Every request with a matcher or a compile in flight."""
        return [*self._matchers, *self._pending]

    def num_live(self) -> int:
        """Matchers and compiles held: 0 once every request has finished (leak checks)."""
        return len(self._matchers) + len(self._pending)

    # -- one step ----------------------------------------------------------------------------------------
    def bitmask(self, plan: SchedulerOutput) -> GrammarBitmask | None:
        """Allowed tokens of the plan's constrained rows that sample, or None when none samples."""
        request_ids = tuple(s.request_id for s in plan.scheduled if s.sample and s.request_id in self._matchers)
        if not request_ids:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(len(request_ids), self._vocab_size)
        for row, request_id in enumerate(request_ids):
            llguidance.torch.fill_next_token_bitmask(self._matchers[request_id], bitmask, row)
            if request_id in self._ignore_eos:
                self._mask_eos(bitmask[row])
        return GrammarBitmask(request_ids, bitmask)

    def _mask_eos(self, row: torch.Tensor) -> None:
        """ignore_eos: EOS is not offered while the grammar allows anything else (a grammar that allows
        only EOS is complete, and the request then ends)."""
        kept = row.clone()
        for token_id in self._eos_token_ids:
            word, bit = divmod(token_id, 32)
            if word < row.numel():
                row[word] &= _signed32(~(1 << bit) & 0xFFFFFFFF)
        if not bool(row.any()):
            row.copy_(kept)

    def advance(self, outputs: Sequence[EngineCoreOutput]) -> tuple[list[str], list[GrammarFailure]]:
        """Feed each constrained request its new tokens. Returns (requests whose grammar is complete
        and allows nothing more: to finish as stopped, failures: a token the grammar refuses)."""
        complete: list[str] = []
        failed: list[GrammarFailure] = []
        for out in outputs:
            matcher = self._matchers.get(out.request_id)
            if matcher is None:
                continue
            if out.new_token_ids and not matcher.consume_tokens(list(out.new_token_ids)):
                failed.append(GrammarFailure(out.request_id, f"a sampled token broke the grammar: {matcher.get_error()}"))
            elif not out.finished and matcher.is_stopped():
                complete.append(out.request_id)
            elif not out.finished:
                continue  # goes on under its grammar
            self.drop([out.request_id])  # finished, complete or failed: its matcher is done
        return complete, failed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compiling (pool threads) ---------------------------------------------------------------------------
    def _new_matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        key = spec.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
            tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > _MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # only a core that serves a constrained request pays

            hf = AutoTokenizer.from_pretrained(self._model_dir)
            eos = self._eos_token_ids or None
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size, eos_token=eos)
        return self._tokenizer
