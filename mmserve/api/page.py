"""The web chat page: `GET /` and `GET /static/{name}` from the package's `static/` folder, each with a
strict Content-Security-Policy. Knows nothing of the engine; the page speaks the public API like any client.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from mmserve.api.errors import APIError

router = APIRouter(include_in_schema=False)

STATIC_DIR = Path(__file__).resolve().parent / "static"
# No inline script or style anywhere; media previews are blob:/data: URLs the page makes itself.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
    "media-src 'self' blob:; connect-src 'self' ws: wss:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}  # fmt: skip
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    # Only plain names of files shipped in static/ (no separators, so no traversal).
    path = STATIC_DIR / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        return APIError(404, f"no static file {name!r}", code="not_found").response()
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=HEADERS)


@router.get("/")
async def index() -> Response:
    return _file("index.html")


@router.get("/static/{name}")
async def static(name: str) -> Response:
    return _file(name)
