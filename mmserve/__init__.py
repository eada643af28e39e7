"""mmserve: a serving engine for vision-language models.

Heavy modules load on first use, so `import mmserve.scheduler` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmserve.request import SamplingParams

if TYPE_CHECKING:
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.llm import LLM
    from mmserve.engine.output_processor import RequestOutput

__all__ = ["LLM", "AsyncEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "mmserve.engine.llm",
    "AsyncEngine": "mmserve.engine.async_engine",
    "RequestOutput": "mmserve.engine.output_processor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
