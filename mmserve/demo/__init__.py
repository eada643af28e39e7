"""The demo model: a small Qwen2-VL trained in this repository on easy-vqa shapes and moving-shape clips
(`mmserve train-demo`), committed under `assets/demo-model/` and served when no model is named."""

from __future__ import annotations

from pathlib import Path

from mmserve.errors import InvalidRequestError

DEMO_MODEL_NAME = "demo"
DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo-model"


def resolve_model(model: str | Path) -> Path:
    """A checkpoint directory for `model`: the name "demo" (unless a local ./demo checkpoint exists) means
    the committed demo model; anything else is a local directory, taken as given."""
    if str(model) == DEMO_MODEL_NAME and not (Path(model) / "config.json").is_file():
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise InvalidRequestError(
                f"model: the demo model is not at {DEMO_MODEL_DIR} (it ships in the source repository; "
                "`mmserve train-demo` rebuilds it)",
                param="model",
            )
        return DEMO_MODEL_DIR
    return Path(model)
