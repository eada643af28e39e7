"""`ServerSettings`: the server's own knobs (auth, storage, size caps, media sources), validated once.

Engine knobs live in `EngineArgs`; these never reach the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MiB = 2**20


class ServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key: str | None = None  # None: no auth. /health and /metrics are always open.
    data_dir: Path = Path("mmserve-data")  # uploads: blobs/<sha256>, files/<id>.json
    # The model id(s) clients send; responses echo the first. None: the engine's path. Any other `model` is a 404.
    served_model_name: str | tuple[str, ...] | None = None
    chat_template: str | None = None  # --chat-template: the template text used instead of the checkpoint's
    tool_call_parser: str | None = None  # --tool-call-parser; None: chosen from the chat template
    # "auto": the checkpoint's generation_config.json gives the sampling defaults; "vllm": OpenAI's defaults.
    generation_config: Literal["auto", "vllm"] = "auto"
    max_body_bytes: int = Field(default=64 * MiB, gt=0)  # any non-upload request body (data URLs inline)
    max_image_upload_bytes: int = Field(default=20 * 1000 * 1000, gt=0)
    max_video_upload_bytes: int = Field(default=200 * 1000 * 1000, gt=0)
    max_ws_message_bytes: int = Field(default=64 * MiB, gt=0)
    allowed_local_media_path: Path | None = None  # chat may read local files under this directory only
    allowed_media_domains: tuple[str, ...] = ()  # hosts chat may fetch media from ("*.example.com" too)
    remote_media_timeout_s: float = Field(default=10.0, gt=0)  # per URL, all redirects included
    allow_private_media_addresses: bool = False  # let allow-listed hosts resolve to private IPs (tests, LANs)
    shutdown_timeout_s: float = Field(default=10.0, ge=0)  # SIGTERM: running requests may finish this long
    # Backpressure and connection limits (see docs/reliability.md).
    max_concurrent_requests_per_key: int | None = Field(default=None, gt=0)  # None: no limit; beyond: 429
    max_header_bytes: int = Field(default=16 * 1024, gt=0)  # request line + headers; beyond: 400, closed
    keep_alive_timeout_s: int = Field(default=5, gt=0)  # an idle HTTP keep-alive connection is closed
    ws_ping_interval_s: float = Field(default=20.0, gt=0)  # and as long to answer a ping, or it is closed
    ws_idle_timeout_s: float = Field(default=300.0, gt=0)  # no message and no response running: closed
    ws_send_queue_events: int = Field(default=1024, gt=0)  # events queued for a socket; beyond: dropped
    ws_send_timeout_s: float = Field(default=30.0, gt=0)  # one frame may wait this long to be sent
    cors_allow_origins: tuple[str, ...] = ()  # () : no CORS headers at all (browsers refuse cross-origin)
    vllm_metric_names: bool = False  # /metrics also under vLLM's names (gateway scorers, autoscalers)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served names, the first being the one responses echo; () : the engine's path."""
        name = self.served_model_name
        if name is None:
            return ()
        return (name,) if isinstance(name, str) else tuple(name)

    @property
    def max_upload_bytes(self) -> int:
        return max(self.max_image_upload_bytes, self.max_video_upload_bytes)
