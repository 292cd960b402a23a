"""GET /playground: the comparison page, static files served as they lie on disk (no build step).

The page and its assets stay reachable without an API key: the browser cannot attach one to a
page load, so the page asks for the key itself and sends it with every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[1] / "static" / "playground"
STATIC_PREFIX = "/playground/static"
PAGE_PATH = "/playground"

router = APIRouter(tags=["playground"])


@router.get(PAGE_PATH, include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def public_paths() -> tuple[str, ...]:
    """The page and every asset under it, as the exact paths the API-key middleware leaves open."""
    assets = sorted(path for path in STATIC_DIR.rglob("*") if path.is_file())
    return (PAGE_PATH, *(f"{STATIC_PREFIX}/{path.relative_to(STATIC_DIR).as_posix()}" for path in assets))


def mount_static(app: FastAPI) -> None:
    """The page's assets under STATIC_PREFIX (the page itself is `router`'s)."""
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="playground-static")
