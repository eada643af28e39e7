"""mmserve's HTTP / WebSocket server: `create_app(engine, settings)` builds the FastAPI app.

Everything here speaks wire formats; the engine below it speaks prompts, `SamplingParams` and outputs.
"""

from mmserve.api.app import create_app
from mmserve.api.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
