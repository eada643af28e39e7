"""API request fields -> `SamplingParams`; `RequestOutput` -> API usage, logprobs, metrics.

The only place the wire's defaults (OpenAI's temperature 1, max_tokens up to the context) are applied.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from mmserve.api.protocol import (
    ChatCompletionRequest,
    ChatFields,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    ResponseMetrics,
    SamplingFields,
    ServiceTier,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mmserve.engine.output_processor import RequestOutput
from mmserve.errors import InvalidRequestError
from mmserve.request import SamplingParams, ServiceClass, StructuredOutputs

logger = logging.getLogger(__name__)

# generation_config.json keys used as request defaults (vLLM's `--generation-config auto`). `min_p` is
# not among them: SamplingParams has no min-p sampling, so a checkpoint's min_p is ignored.
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for the legacy completions API


def generation_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults of a checkpoint's `generation_config.json` (temperature, top_p, top_k,
    repetition_penalty), as vLLM's `--generation-config auto` reads them; {} without the file.
    `do_sample: false` is not read as greedy (vLLM does not either): only the values given count."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    return {k: config[k] for k in _GENERATION_DEFAULTS if isinstance(config.get(k), (int, float))}


def sampling_params(
    fields: SamplingFields,
    max_model_len: int,
    defaults: Mapping[str, Any] | None = None,
    *,
    structured: StructuredOutputs | None = None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Raises InvalidRequestError (-> 400) for values SamplingParams refuses. `defaults`: the checkpoint's
    (`generation_defaults`) for the fields the request omits; OpenAI's (temperature 1, ...) otherwise.
    `structured`: the constraint of `structured_outputs(fields)` (or of a tool choice) when already made."""
    defaults = defaults or {}
    max_tokens = fields.max_tokens
    if isinstance(fields, ChatCompletionRequest) and fields.max_completion_tokens is not None:
        max_tokens = fields.max_completion_tokens
    if max_tokens is None:
        # None: up to the context (the scheduler stops a request at max_model_len), or the API's default.
        max_tokens = default_max_tokens if default_max_tokens is not None else max_model_len
    logprobs = None
    if isinstance(fields, ChatCompletionRequest) and fields.logprobs:
        logprobs = fields.top_logprobs or 0
    if isinstance(fields, CompletionRequest) and fields.logprobs is not None:
        logprobs = fields.logprobs

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(fields, name)
        return value if value is not None else defaults.get(name, fallback)

    top_k = pick("top_k", None)
    if structured is None:
        structured = structured_outputs(fields)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=top_k if top_k not in (None, 0, -1) else None,
        seed=fields.seed,
        stop=fields.stop,
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        logprobs=logprobs,
        priority=fields.priority,
        service_class=service_class(fields.service_tier),
        slo=fields.slo.model_dump() if fields.slo is not None else None,
        n=fields.n,
        structured_outputs=structured,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        logit_bias=dict(fields.logit_bias or {}),  # type: ignore[arg-type]  # parsed (str keys) by SamplingParams
        min_tokens=fields.min_tokens,
        bad_words=tuple(fields.bad_words or ()),
        kv_transfer=getattr(fields, "kv_transfer_params", None),
    )


def check_kv_transfer(params: SamplingParams, stream: bool, num_prompts: int = 1) -> None:
    """A prefill instance answers `do_remote_decode` in the body of one non-streamed response."""
    kv = params.kv_transfer
    if kv is None or not kv.do_remote_decode:
        return
    if stream:
        raise InvalidRequestError(
            "kv_transfer_params.do_remote_decode: the answer comes in the response body; stream must be false",
            param="kv_transfer_params",
        )
    if num_prompts != 1:
        raise InvalidRequestError(
            "kv_transfer_params.do_remote_decode: one prompt per request", param="kv_transfer_params"
        )


def kv_transfer_params(out: RequestOutput) -> dict[str, Any] | None:
    return out.kv_transfer_params.to_json() if out.kv_transfer_params is not None else None


def structured_outputs(fields: SamplingFields) -> StructuredOutputs | None:
    """`response_format`, vLLM's `structured_outputs` or its older `guided_*` fields -> one constraint.
    More than one of them is a 400 (which would win is not obvious)."""
    found: list[tuple[str, StructuredOutputs]] = []

    def make(param: str, **kwargs: Any) -> None:
        if "json" in kwargs and not isinstance(kwargs["json"], str):
            kwargs["json"] = json.dumps(kwargs["json"])
        try:
            found.append((param, StructuredOutputs(**kwargs)))
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc).replace("structured_outputs", param, 1), param=param) from None

    fmt = fields.response_format if isinstance(fields, ChatFields) else None
    if fmt is not None and fmt.type == "json_object":
        make("response_format", json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format.json_schema: a json_schema response format needs json_schema.schema",
                param="response_format.json_schema",
            )
        make("response_format", json=fmt.json_schema.schema_)
    spec = fields.structured_outputs
    if spec is not None:
        given = {k: v for k, v in (("json", spec.json_), ("regex", spec.regex), ("choice", spec.choice),
                                   ("grammar", spec.grammar), ("json_object", spec.json_object or None))
                 if v is not None}  # fmt: skip
        make("structured_outputs", **given)
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(fields, f"guided_{name}")
        if value is not None:
            make(f"guided_{name}", **{name: value})
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise InvalidRequestError(f"{names}: give at most one output constraint", param=found[1][0])
    return found[0][1] if found else None


def check_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> None:
    """A `max_tokens` the client asked for that cannot fit beside the prompt is a 400 (never cut silently)."""
    room = max_model_len - num_prompt_tokens
    if requested is not None and requested > room:
        raise InvalidRequestError(
            f"max_tokens: {requested} tokens were asked for, but the prompt's {num_prompt_tokens} tokens leave "
            f"room for {room} within max_model_len={max_model_len}",
            param="max_tokens",
        )


def requested_max_tokens(fields: SamplingFields) -> int | None:
    if isinstance(fields, ChatCompletionRequest) and fields.max_completion_tokens is not None:
        return fields.max_completion_tokens
    return fields.max_tokens


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


def usage(*outs: RequestOutput) -> Usage:
    """Usage of one request's outputs: each prompt counted once (its sequence 0: the n > 1 sequences share
    it), completion tokens summed over every sequence."""
    firsts = [o for o in outs if o.index == 0] or list(outs[:1])
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    cached = sum(o.metrics.num_cached_tokens for o in firsts if o.metrics is not None)
    completion = sum(len(o.token_ids) for o in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))  # fmt: skip


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


def completion_logprobs(
    out: RequestOutput, tokenizer: PreTrainedTokenizerBase, start: int, top_n: int, offset: int
) -> CompletionLogprobs | None:
    """The legacy completions shape for tokens [start, len(out.token_ids)); `offset`: where the first of
    them starts in the choice's text."""
    if out.logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
        text = tokenizer.decode([token_id])
        result.tokens.append(text)
        result.token_logprobs.append(max(entry.get(token_id, float("-inf")), -9999.0))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        result.top_logprobs.append({tokenizer.decode([t]): max(lp, -9999.0) for t, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


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
