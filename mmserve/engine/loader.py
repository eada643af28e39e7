"""Builds what the front ends stand on from `EngineArgs` and a local checkpoint directory (never a
download): the checked checkpoint path, the tokenizer and the processor; and, for `LLM`, an engine
core in the same process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mmserve.config import EngineArgs
from mmserve.demo import resolve_model
from mmserve.encoders.media import DEFAULT_LIMITS, MediaLimits
from mmserve.engine.mm_processor import MultiModalProcessor
from mmserve.engine.processor import Processor
from mmserve.errors import InvalidRequestError
from mmserve.models.config import DecoderConfig


@dataclass(frozen=True, eq=False)
class LoadedEngine:
    tokenizer: PreTrainedTokenizerBase
    core: object  # EngineCore
    processor: Processor


def resolve_checkpoint(args: EngineArgs) -> EngineArgs:
    """`args` with `model` resolved to a checkpoint directory; one clear error if it is not one."""
    args = dataclasses.replace(args, model=str(resolve_model(args.model)))
    if not (Path(args.model) / "config.json").is_file():
        raise InvalidRequestError(
            f"model: {args.model} is not a checkpoint directory (no config.json); mmserve loads local "
            "directories only and never downloads (make one with `mmserve make-tiny-model DIR`)",
            param="model",
        )
    return args


def load_frontend(
    args: EngineArgs, max_model_len: int, media_limits: MediaLimits | None = None
) -> tuple[PreTrainedTokenizerBase, Processor]:
    """The tokenizer and the processor (templating, tokenizing, media) for a resolved checkpoint."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model_config, hf_config = DecoderConfig.from_pretrained(args.model)
    mm_processor = None
    if getattr(hf_config, "vision_config", None) is not None:
        mm_processor = MultiModalProcessor(
            args.model,
            hf_config,
            media_limits or DEFAULT_LIMITS,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            max_model_len=max_model_len,
        )
    processor = Processor(
        tokenizer, model_config.vocab_size, max_model_len, model_config.eos_token_ids, mm_processor
    )
    return tokenizer, processor


def load_engine(args: EngineArgs, media_limits: MediaLimits | None = None) -> LoadedEngine:
    """An in-process engine core with its tokenizer and processor (`LLM`)."""
    from mmserve.engine.core import EngineCore

    args = resolve_checkpoint(args)
    core = EngineCore(args)
    try:
        tokenizer, processor = load_frontend(args, core.max_model_len, media_limits)
    except BaseException:
        core.close()  # its tensor-parallel ranks, if any
        raise
    return LoadedEngine(tokenizer, core, processor)
