"""Turns user prompts into `Request`s: chat template, tokenizing, validation against the model.

Text and templates end here; the engine core only ever sees token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from mmserve.errors import InvalidRequestError, PromptTooLongError
from mmserve.request import Request, SamplingParams

# A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
PromptType = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class Processor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def process(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> tuple[Request, str | None]:
        """Returns the request and the prompt text (None when the prompt came as token ids)."""
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt: {len(token_ids)} tokens leave no room for output within max_model_len={self.max_model_len}",
                param="prompt",
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt: token ids {bad[:5]} are outside [0, {self.vocab_size})", param="prompt"
            )
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids)
        return request, text

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if (
            not isinstance(messages, Sequence)
            or not messages
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise InvalidRequestError(
                "messages: must be a non-empty list of {role, content} objects", param="messages"
            )
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises many types; the user sees one clear error
            raise InvalidRequestError(
                f"messages: the chat template could not render them ({exc})", param="messages"
            ) from exc

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_token_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise InvalidRequestError(
                "prompt: a dict prompt needs 'prompt' (str) or 'prompt_token_ids'", param="prompt"
            )
        return None, _as_token_ids(prompt)

    def _encode(self, text: str) -> list[int]:
        # Chat-templated text already holds its special tokens; Qwen tokenizers add none anyway.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_token_ids(value: object) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidRequestError("prompt: must be a string, a list of token ids, or a dict", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError("prompt: token ids must be integers", param="prompt")
    return list(value)
