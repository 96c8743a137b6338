"""The live dashboard: ``GET /dashboard`` (one self-contained page), ``GET /dashboard/data`` (the stats history as
JSON) and ``/dashboard/static/`` (the page's script and style, and the vendored uPlot charting library; no CDN).

The page polls ``/dashboard/data`` every second and plots the last minutes: tokens/s, running and waiting
requests, KV-cache usage, prefix-cache hit rate, TTFT and TPOT percentiles (see ``metrics/history.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

if TYPE_CHECKING:
    from pagellm.server.observability import Observability

STATIC_DIR = Path(__file__).parent / "static"


def install_dashboard(app: FastAPI, obs: Observability) -> None:
    router = APIRouter(include_in_schema=False)
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")

    @router.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/data")
    async def data(window: int = Query(300, ge=10, le=3600)) -> dict[str, Any]:
        snapshot = obs.history.snapshot(window)
        snapshot.update(model_name=obs.model_name, stats_enabled=obs.log_stats)
        return snapshot

    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
