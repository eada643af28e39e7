"""Turns user prompts into `Request`s: chat template, tokenizing, validation against the model.

Text and templates end here; the engine core only ever sees token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from mmserve.engine import structured_output
from mmserve.engine.mm_processor import MultiModalProcessor
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
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.mm_processor = mm_processor

    def process(
        self, prompt: PromptType, params: SamplingParams, request_id: str, arrival_time: float | None = None
    ) -> tuple[Request, str | None]:
        """Returns the request and the prompt text (None when the prompt came as token ids).
        `arrival_time` (time.monotonic()): when the request was received; default now."""
        structured_output.check(params.structured_outputs)  # a 400 naming what cannot compile
        params = self._with_bad_word_ids(params)
        self._check_token_ids(params)
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
        expanded = None
        images, videos = (
            (_media_list(prompt, "images"), _media_list(prompt, "videos"))
            if isinstance(prompt, Mapping)
            else ([], [])
        )
        if (images or videos) and self.mm_processor is None:
            raise InvalidRequestError("prompt: this model takes no images or videos", param="prompt")
        # Placeholders without media are refused too (expand checks that the counts match).
        if self.mm_processor is not None and (
            images or videos or self.mm_processor.has_placeholders(token_ids)
        ):
            expanded = self.mm_processor.expand(token_ids, images, videos)
            token_ids = expanded.token_ids
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
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if expanded is not None:
            request.mm_inputs = expanded.mm_inputs
            request.mrope_positions = expanded.mrope_positions
            request.mrope_delta = expanded.mrope_delta
        return request, text

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` -> token sequences: each word alone and with a leading space, when that spelling
        tokenizes to as many tokens and starts differently (vLLM's rule). Idempotent."""
        if not params.bad_words:
            return params
        sequences = list(params.bad_words_token_ids)
        for word in params.bad_words:
            plain = self._encode(word.lstrip())
            spaced = self._encode(" " + word.lstrip())
            spellings = [plain]
            if len(spaced) == len(plain) and spaced[:1] != plain[:1]:
                spellings.append(spaced)
            sequences += [tuple(ids) for ids in spellings if ids and tuple(ids) not in sequences]
        return dataclasses.replace(params, bad_words_token_ids=tuple(sequences))

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias, bad words, stop ids) must be in the vocabulary."""
        named = (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("bad_words_token_ids", [t for seq in params.bad_words_token_ids for t in seq]),
            ("stop_token_ids", list(params.stop_token_ids)),
        )
        for param, ids in named:
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"{param}: token ids {outside[:5]} are outside [0, {self.vocab_size})", param=param
                )

    def chat_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A conversation with OpenAI-style content parts -> {"prompt", "images", "videos"}, media in the
        order their parts appear (which is the order the template writes their placeholders). The keyword
        options are `apply_chat_template`'s."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        images: list[object] = []
        videos: list[object] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) or content is None:
                continue
            if not isinstance(content, Sequence):
                raise InvalidRequestError(
                    "messages: content must be a string or a list of parts", param="messages"
                )
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in ("image", "image_url"):
                    images.append(_part_source(part, kind))
                elif kind in ("video", "video_url"):
                    videos.append(_part_source(part, kind))
                elif kind != "text":
                    raise InvalidRequestError(
                        f"messages: unknown content part type {kind!r}; expected one of text, image_url, "
                        "video_url, image, video",
                        param="messages",
                    )
        return {"prompt": text, "images": images, "videos": videos}

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation. `tools` (OpenAI tool dicts) are written by the template;
        `continue_final_message` leaves the last message open, so the model continues it (vLLM's option;
        not with `add_generation_prompt`); `chat_template`: a template text used instead of the checkpoint's;
        `chat_template_kwargs`: extra variables for the template."""
        if (
            not isinstance(messages, Sequence)
            or not messages
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise InvalidRequestError(
                "messages: must be a non-empty list of {role, content} objects", param="messages"
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt",
                param="continue_final_message",
            )
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **dict(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja raises many types; the user sees one clear error
            param = "chat_template" if chat_template is not None else "messages"
            raise InvalidRequestError(
                f"{param}: the chat template could not render the messages ({exc})", param=param
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


def _media_list(prompt: Mapping[str, Any], key: str) -> list[object]:
    value = prompt.get(key) or []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{key}: must be a list", param=key)
    return list(value)


def _part_source(part: Mapping[str, Any], kind: str) -> object:
    """The media of a content part: {"image_url": {"url": ...}}, {"image_url": "..."} or {"image": ...}."""
    value = part.get(kind)
    if isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(
            f"messages: a {kind} part needs its {kind} (a URL, path or data)", param="messages"
        )
    return value


def _as_token_ids(value: object) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidRequestError("prompt: must be a string, a list of token ids, or a dict", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError("prompt: token ids must be integers", param="prompt")
    return list(value)
