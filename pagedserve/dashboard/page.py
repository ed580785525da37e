"""Routes that serve the dashboard page and its assets from the package (no CDN, no key needed:
the page holds no data until it has fetched some with the key)."""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _read(name: str) -> bytes:
    return resources.files("pagedserve.dashboard").joinpath("static", name).read_bytes()


def page_router(config: dict) -> APIRouter:
    """GET /dashboard, its assets, and /dashboard/config (what the page is looking at)."""
    router = APIRouter()
    assets = {name: _read(name) for name in _ASSETS}
    index = _read("index.html")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(index, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            return JSONResponse({"error": {"message": f"no dashboard asset {name!r}", "type": "not_found",
                                           "param": "name", "code": None}}, status_code=404)
        return Response(assets[name], media_type=_ASSETS[name], headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/config", include_in_schema=False)
    async def dashboard_config() -> dict:
        return config

    return router
