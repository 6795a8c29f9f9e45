"""The API's interactive documentation, `/docs` (Swagger UI) and `/redoc`, served
from this listener: FastAPI's own pages load their scripts and styles from a CDN,
so on a machine without internet (or behind a strict proxy) they stay blank.  The
files come from the `fastapi-offline` package (Swagger UI 5, which reads the
OpenAPI 3.1 that FastAPI writes, and ReDoc), installed with the broker."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

ASSETS_URL = "/docs-assets"
ASSET_TYPES = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
               "swagger-ui.css": "text/css; charset=utf-8",
               "redoc.standalone.js": "text/javascript; charset=utf-8",
               "favicon.png": "image/png"}


def assets_dir() -> Path:
    import fastapi_offline
    return Path(fastapi_offline.__file__).parent / "static"


def add_api_docs(app: FastAPI) -> None:
    """Routes for /docs, /redoc and their files; `app` was made with docs_url=None
    and redoc_url=None."""
    folder = assets_dir()
    title = app.title

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{title} - Swagger UI",
                                   oauth2_redirect_url="/docs/oauth2-redirect",
                                   swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS_URL}/favicon.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{title} - ReDoc",
                              redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False)

    @app.get(ASSETS_URL + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSET_TYPES:
            return Response(status_code=404)
        return Response((folder / name).read_bytes(), media_type=ASSET_TYPES[name],
                        headers={"Cache-Control": "max-age=86400"})


__all__ = ["ASSETS_URL", "add_api_docs"]
