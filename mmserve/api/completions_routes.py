"""`POST /v1/completions`, OpenAI's legacy text completions: a prompt as text or token ids, or a list of
either (several prompts: choices indexed across them, n per prompt), JSON or SSE, `echo`, `logprobs` in the
completions shape. Shares starting, merging and draining the engine streams with the chat route."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mmserve.api import convert, serving
from mmserve.api.app import ServerState, State
from mmserve.api.errors import APIError
from mmserve.api.limits import bearer, key_id
from mmserve.api.openai_routes import refuse_unsupported
from mmserve.api.protocol import Completion, CompletionChoice, CompletionRequest
from mmserve.engine.output_processor import RequestOutput

router = APIRouter()
_MAX_LOGPROBS = 20


def _prompts(prompt: str | list[int] | list[str | list[int]]) -> list[str | list[int]]:
    """The request's prompts: one text, one list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", code="invalid_request_error", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]  # list[int]
    return list(prompt)  # type: ignore[arg-type]  # texts and token-id lists


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, state: State
) -> Completion | StreamingResponse:
    arrival_time = time.monotonic()
    state.check_model(body.model)
    refuse_unsupported(body)
    if body.logprobs is not None and not 0 <= body.logprobs <= _MAX_LOGPROBS:
        raise APIError(400, f"logprobs: must be an integer in [0, {_MAX_LOGPROBS}], got {body.logprobs}",
                       code="invalid_request_error", param="logprobs")  # fmt: skip
    if body.echo and body.logprobs is not None:
        raise APIError(400, "logprobs: the prompt's logprobs (echo with logprobs) are not supported",
                       code="unsupported_parameter", param="logprobs")  # fmt: skip
    engine = state.engine
    prompts = _prompts(body.prompt)
    release = state.limiter.acquire(key_id(bearer(request.headers.get("authorization"))))
    try:
        params = convert.sampling_params(
            body, engine.max_model_len, state.generation_defaults,
            default_max_tokens=convert.COMPLETIONS_DEFAULT_MAX_TOKENS,
        )  # fmt: skip
        convert.check_kv_transfer(params, body.stream, len(prompts))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [
            engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{k}", arrival_time=arrival_time)
            for k, p in enumerate(prompts)
        ]  # fmt: skip
        firsts = await serving.start(streams)
        try:
            for first in firsts:
                convert.check_max_tokens(body.max_tokens, len(first.prompt_token_ids), engine.max_model_len)
        except BaseException:
            await serving.close_all(streams)
            raise
    except BaseException:
        release()
        raise
    outputs = serving.merged(streams, firsts, body.n, on_close=release)
    # Choice k * n + i echoes prompt k.
    echoes = [_prompt_text(state, f) if body.echo else "" for f in firsts]
    top_n = body.logprobs or 0
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        events = _sse(state, outputs, body.n, echoes, request_id, include_usage, continuous, top_n)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    finals = await serving.final_outputs(request, outputs)
    choices = []
    for index in sorted(finals):
        out, echo = finals[index], echoes[index // body.n]
        logprobs = convert.completion_logprobs(out, engine.tokenizer, 0, top_n, len(echo))
        choices.append(CompletionChoice(index=index, text=echo + out.text, logprobs=logprobs,
                                        finish_reason=out.finish_reason))  # fmt: skip
    return Completion(
        id=request_id, model=state.model_name, choices=choices, usage=convert.usage(*finals.values()),
        kv_transfer_params=convert.kv_transfer_params(finals[min(finals)]),
    )  # fmt: skip


def _prompt_text(state: ServerState, first: RequestOutput) -> str:
    if first.prompt is not None:
        return first.prompt
    return state.engine.tokenizer.decode(first.prompt_token_ids)


async def _sse(
    state: ServerState,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    echoes: list[str],
    request_id: str,
    include_usage: bool,
    continuous_usage: bool,
    top_n: int,
) -> AsyncIterator[str]:
    created = int(time.time())
    tokenizer = state.engine.tokenizer
    latest: dict[int, RequestOutput] = {}
    sent: dict[int, tuple[int, int]] = {}  # choice -> (tokens sent, characters sent)

    def usage() -> dict[str, Any] | None:
        return convert.usage(*latest.values()).model_dump(exclude_none=True) if latest else None

    def chunk(choices: list[dict[str, Any]], usage_value: object = None) -> str:
        data: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                "model": state.model_name, "choices": choices}  # fmt: skip
        if include_usage:
            data["usage"] = usage_value if usage_value is not None or not continuous_usage else usage()
        return serving.sse(data)

    async with serving.aclosing(outputs):  # leaving early (disconnect -> cancellation) aborts the requests
        try:
            async for index, out in outputs:
                latest[index] = out
                tokens, chars = sent.get(index, (0, 0))
                text = out.new_text
                if index not in sent:
                    text = echoes[index // n] + text
                if not text and not out.finished and index in sent:
                    continue
                logprobs = convert.completion_logprobs(
                    out, tokenizer, tokens, top_n, chars + len(text) - len(out.new_text)
                )
                sent[index] = (len(out.token_ids), chars + len(text))
                choice = {"index": index, "text": text, "finish_reason": out.finish_reason,
                          "logprobs": logprobs.model_dump() if logprobs is not None else None}  # fmt: skip
                yield chunk([choice])
        except Exception as exc:  # the stream has started: report in-band
            yield serving.sse_error(exc)
            return
        if include_usage:
            yield chunk([], usage())
        yield "data: [DONE]\n\n"
