"""Incremental detokenization of one request's output: UTF-8-safe text deltas and stop strings.

Knows a Hugging Face tokenizer and token ids; nothing of the engine, scheduler or wire format.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: detokenizing needs no torch / transformers import
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded in front of the first output tokens so that they get the leading-space
# handling they have in context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a decoder renders for bytes of a character that has not finished
# What `DecodeStream.step` raises (untyped) when a window's text does not begin with the text of its
# first tokens, which some decoders' whole-string rules (clean-up, replacements) can cause.
_INVALID_PREFIX = "Invalid prefix encountered"

_skipped_ids_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset[int]] = (
    weakref.WeakKeyDictionary()
)  # per tokenizer: built once, not per request


def _skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens flagged special.

    Dropping them before they enter the window is only an optimisation (the window decode skips
    them too), so a set that misses some is safe; one with extras would not be.
    """
    ids = _skipped_ids_cache.get(tokenizer)
    if ids is None:
        ids = frozenset(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        _skipped_ids_cache[tokenizer] = ids
    return ids


def _rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a fast tokenizer, or None (a slow one)."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    return backend if isinstance(backend, Tokenizer) else None


def _window_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """`ids -> text` as `tokenizer.decode` gives it without clean-up (vLLM does not clean up either).

    A fast tokenizer's Rust backend is called directly: same text, a third of the cost.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns the token ids of one output, a few at a time, into finalized text deltas.

    Decoding keeps vLLM's window `ids[prefix_offset:]`: the text of `ids[prefix_offset:read_offset]`
    was emitted already, so decoding the window and cutting that prefix off yields the new text
    with the spacing it has in context. The window moves on as soon as its text no longer ends
    in an unfinished character, so it stays a few tokens long and each update costs O(window).

    With a fast tokenizer each token is one call into `tokenizers`' `DecodeStream`, which runs
    the same window in Rust (the text of the window's first tokens is kept rather than decoded
    again). The window's ids are mirrored here, so `flush` and a fallback to the Python window
    (when the stream meets a window whose text does not extend its prefix) continue from the
    same state; the deltas are the same either way.

    Stop strings act on the decoded text: the longest tail that could still begin a stop string
    is held back until it either completes one (the output stops) or can no longer.
    """

    output_text: str
    stop_reason: str | None

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        decode_stream: bool = True,
    ) -> None:
        """`min_tokens`: stop strings end the output only once this many tokens exist (vLLM's rule).

        `decode_stream=False` decodes with the Python window only: the reference the stream is
        tested against.
        """
        self._decode = _window_decoder(tokenizer, skip_special_tokens)
        self._skipped = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output tokens seen so far (special ones included)
        self.output_text = ""
        self.stop_reason = None

        context: list[int] = []
        for token_id in reversed(prompt_token_ids):  # only the tail: O(context), not O(prompt)
            if len(context) == _PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._skipped:
                context.append(token_id)
        context.reverse()
        if self._decode(context).endswith(_INCOMPLETE):
            # A prompt cut mid-character would make the output's first bytes rewrite its tail.
            context = []
        self._ids: list[int] = context  # the window; ids before it are never needed again
        self._read_offset = len(context)  # ids[:read_offset] are in the emitted text
        self._held = ""  # decoded text not emitted yet because it may begin a stop string
        self._finished = False
        self._rust = _rust_tokenizer(tokenizer) if decode_stream else None
        self._stream: DecodeStream | None = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Adds output tokens; returns the text they finalized (often "", never a partial character)."""
        if self._finished:
            return ""
        self._num_tokens += len(new_token_ids)
        decoded = "".join(self._push(token_id) for token_id in new_token_ids)
        return self._emit(decoded, final=False)

    def flush(self) -> str:
        """At finish without a stop string: releases the held text, unfinished characters included."""
        if self._finished:
            return ""
        prefix = self._decode(self._ids[: self._read_offset])
        rest = self._decode(self._ids)[len(prefix) :]
        self._advance_window()
        delta = self._emit(rest, final=True)
        self._finished = True
        return delta

    def _push(self, token_id: int) -> str:
        """Appends one id to the window; returns the text it finalized."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._rust, token_id)
            except Exception as error:  # tokenizers raises it untyped
                if not str(error).startswith(_INVALID_PREFIX):
                    raise
                self._stream = None  # this window and the rest of the output: the Python window
            else:
                if text is None:
                    return ""
                self._advance_window()
                return text
        prefix = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        # No growth: e.g. a sentencepiece "▁" whose space shows only once a word follows it.
        if len(text) <= len(prefix) or text.endswith(_INCOMPLETE):
            return ""
        self._advance_window()
        return text[len(prefix) :]

    def _advance_window(self) -> None:
        """The window's text is emitted: the tokens from read_offset on become the next window's context."""
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)

    def _emit(self, decoded: str, *, final: bool) -> str:
        """Runs stop-string matching over held + decoded text; returns the text now safe to emit."""
        text = self._held + decoded
        match = self._find_stop(text) if self._num_tokens >= self._min_tokens else None
        if match is not None:
            start, stop = match
            delta = text[: start + len(stop)] if self._include_stop else text[:start]
            self.stop_reason = stop
            self._finished = True
            self._held = ""
        else:
            hold = 0 if final else self._stop_prefix_len(text)
            delta = text[: len(text) - hold]
            self._held = text[len(text) - hold :]
        self.output_text += delta
        return delta

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that `text` completes first (earliest end, then longest) and its start."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stop), default=1) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stop):
                return n
        return 0
