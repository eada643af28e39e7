"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes: a prompt, or messages rendered by the chat
template (media expanded to their embedding tokens), to token ids; token ids back to text."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter

from mmserve.api.app import State
from mmserve.api.chat_request import template_options, with_tool_fields
from mmserve.api.errors import APIError
from mmserve.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from mmserve.request import SamplingParams

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    state.check_model(body.model)
    engine = state.engine
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt, messages", code="invalid_request_error",
                       param="prompt" if body.prompt is None else "messages")  # fmt: skip
    if body.prompt is not None:
        tokens = list(engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    else:
        assert body.messages is not None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        template = template_options(state, body, tools)
        messages, _ = await state.resolver.resolve(body.messages)
        prompt = engine.processor.chat_prompt(with_tool_fields(messages, body.messages), **template)
        if prompt["images"] or prompt["videos"]:  # their placeholders expand to the embedding tokens
            request, _ = await asyncio.get_running_loop().run_in_executor(
                None,
                engine.processor.process,
                prompt,
                SamplingParams(max_tokens=1),
                f"tok-{uuid.uuid4().hex}",
            )
            tokens = list(request.prompt_token_ids)
        else:
            tokens = list(engine.tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"])
    strs = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strs
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.check_model(body.model)
    vocab = state.engine.processor.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens: token ids {bad[:5]} are outside [0, {vocab})", code="invalid_request_error",
                       param="tokens")  # fmt: skip
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))
