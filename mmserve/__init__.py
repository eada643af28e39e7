"""mmserve: a serving engine for vision-language models."""

from mmserve.engine.llm import LLM
from mmserve.engine.output_processor import RequestOutput
from mmserve.request import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
