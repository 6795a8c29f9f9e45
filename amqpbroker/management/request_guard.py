"""The management API's first middleware: `check_request` (request_policy.py: Host
against DNS rebinding; Origin and Content-Type of changes against cross-site
requests) on every HTTP request, before routing and authentication.  Used by the
live broker's API (api.py) and a backup's read-only one (ha.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from .request_policy import HostPolicy, check_request

log = logging.getLogger("amqpbroker.management")


class RequestGuard:
    """ASGI middleware: `check_request` on every HTTP request, before routing and
    authentication.  A refusal is logged once, then at most every 10 s with a count
    (a hostile page can send many)."""

    def __init__(self, app: Any, policy: HostPolicy):
        self.app = app
        self.policy = policy
        self._logged_at = float("-inf")
        self._unlogged = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        has_body = headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers
        refusal = check_request(self.policy, method=scope["method"], scheme=scope.get("scheme", "http"),
                                host=headers.get("host"), origin=headers.get("origin"),
                                content_type=headers.get("content-type"), has_body=has_body)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self._log(scope, refusal.error)
        await JSONResponse({"error": refusal.error}, status_code=refusal.status)(scope, receive, send)

    def _log(self, scope: dict, error: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < 10.0:
            self._unlogged += 1
            return
        client = scope.get("client") or ("?", 0)
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning("management API: refused %s %s from %s: %s%s", scope["method"], scope.get("path", ""),
                    client[0], error, more)
        self._logged_at = now
        self._unlogged = 0
