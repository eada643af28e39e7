"""Builds what both front ends (`LLM`, `AsyncEngine`) stand on: the tokenizer, the engine core and
the processor, from `EngineArgs` and a local checkpoint directory (never a download)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mmserve.config import EngineArgs
from mmserve.demo import resolve_model
from mmserve.encoders.media import DEFAULT_LIMITS, MediaLimits
from mmserve.engine.core import EngineCore
from mmserve.engine.mm_processor import MultiModalProcessor
from mmserve.engine.processor import Processor
from mmserve.errors import InvalidRequestError


@dataclass(frozen=True, eq=False)
class LoadedEngine:
    tokenizer: PreTrainedTokenizerBase
    core: EngineCore
    processor: Processor


def load_engine(args: EngineArgs, media_limits: MediaLimits | None = None) -> LoadedEngine:
    args = dataclasses.replace(args, model=str(resolve_model(args.model)))
    if not (Path(args.model) / "config.json").is_file():
        raise InvalidRequestError(
            f"model: {args.model} is not a checkpoint directory (no config.json); mmserve loads local "
            "directories only and never downloads (make one with `mmserve make-tiny-model DIR`)",
            param="model",
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    core = EngineCore(args)
    mm_processor = None
    if getattr(core.hf_config, "vision_config", None) is not None:
        mm_processor = MultiModalProcessor(args.model, core.hf_config, media_limits or DEFAULT_LIMITS)
    processor = Processor(
        tokenizer,
        core.model_config.vocab_size,
        core.max_model_len,
        core.model_config.eos_token_ids,
        mm_processor,
    )
    return LoadedEngine(tokenizer, core, processor)
