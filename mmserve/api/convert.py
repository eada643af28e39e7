"""API request fields -> `SamplingParams`; `RequestOutput` -> API usage, logprobs, metrics.

The only place the wire's defaults (OpenAI's temperature 1, max_tokens up to the context) are applied.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from mmserve.api.protocol import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    ResponseMetrics,
    SamplingFields,
    ServiceTier,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mmserve.engine.output_processor import RequestOutput
from mmserve.request import SamplingParams, ServiceClass


def sampling_params(fields: SamplingFields, max_model_len: int) -> SamplingParams:
    """Raises InvalidRequestError (-> 400) for values SamplingParams refuses."""
    max_tokens = fields.max_tokens
    if isinstance(fields, ChatCompletionRequest) and fields.max_completion_tokens is not None:
        max_tokens = fields.max_completion_tokens
    logprobs = None
    if isinstance(fields, ChatCompletionRequest) and fields.logprobs:
        logprobs = fields.top_logprobs or 0
    return SamplingParams(
        # None: up to the context; the scheduler stops a request at max_model_len.
        max_tokens=max_tokens if max_tokens is not None else max_model_len,
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=fields.top_k if fields.top_k not in (None, 0) else None,
        seed=fields.seed,
        stop=fields.stop,
        ignore_eos=fields.ignore_eos,
        logprobs=logprobs,
        priority=fields.priority,
        service_class=service_class(fields.service_tier),
        slo=fields.slo.model_dump() if fields.slo is not None else None,
    )


def service_class(tier: ServiceTier | None) -> ServiceClass:
    """OpenAI's service tier -> mmserve's class: "flex" is batch work; no tier, "auto", "default" and
    "priority" are a person waiting (interactive)."""
    return ServiceClass.BATCH if tier == "flex" else ServiceClass.INTERACTIVE


def service_tier(requested: ServiceTier | None, out: RequestOutput | None) -> ServiceTier:
    """The tier to echo: the class the engine actually served the request in (admission control may have
    downgraded an interactive request to batch -> "flex"); an interactive request echoes the tier it
    asked for, "default" for none or "auto" (as OpenAI does)."""
    served = out.service_class if out is not None else service_class(requested)
    if served == ServiceClass.BATCH:
        return "flex"
    return "priority" if requested == "priority" else "default"


def usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def logprobs(
    out: RequestOutput, tokenizer: PreTrainedTokenizerBase, start: int, top_n: int
) -> ChoiceLogprobs | None:
    """OpenAI's shape for tokens [start, len(out.token_ids)). `out.logprobs[i]` maps token id -> logprob
    for the chosen token and the top-k; the top list is the `top_n` most likely of them."""
    if out.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            TokenLogprob(
                **_token(tokenizer, token_id, entry.get(token_id, float("-inf"))).model_dump(),
                top_logprobs=[_token(tokenizer, t, lp) for t, lp in top],
            )
        )
    return ChoiceLogprobs(content=content)


def _token(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id])
    return TopLogprob(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8")))


def response_metrics(out: RequestOutput) -> ResponseMetrics:
    m = out.metrics
    if m is None or m.first_token_time is None:
        return ResponseMetrics(ttft_ms=None, tokens_per_s=None)
    end = m.finish_time or m.last_token_time or m.first_token_time
    elapsed = end - m.arrival_time
    return ResponseMetrics(
        ttft_ms=round((m.first_token_time - m.arrival_time) * 1000, 3),
        tokens_per_s=round(len(out.token_ids) / elapsed, 3) if elapsed > 0 else None,
    )
