"""The HA pair as management shows it (GET /api/ha, /metrics; docs/ha.md).

Read through the ManagedBroker port's `ha`: the pair's node (an object with
`describe()`), or None for a broker that runs alone.  A backup has no broker model
and no full management API: `BackupApi` serves the same /api/ha and the HA series
of /metrics (plus /api/health, for a container health check) read-only, on the
management listener's address, until the node is live and the full API takes the
port over."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace
from typing import Any

from .http_server import embedded_server

log = logging.getLogger("amqpbroker.management")

PEER_STATES = ("alone", "syncing", "catching", "in-sync", "lost")


def ha_view(managed: Any) -> dict:
    node = getattr(managed, "ha", None)
    if node is None:
        return {"enabled": False}
    return node.describe()


def ha_figures(managed: Any) -> dict[str, tuple[str, str, float]]:
    """Gauges of the pair, on the live broker and on the backup; none alone."""
    node = getattr(managed, "ha", None)
    if node is None:
        return {}
    view = node.describe()
    zk = view["zookeeper"]
    out = {
        "amqpbroker_ha_live": ("gauge", "1 while this broker is the pair's live broker", int(view["status"] == "live")),
        "amqpbroker_ha_accepting": ("gauge", "1 while this broker accepts (an accept window is open)",
                                    int(view.get("accepting", False))),
        "amqpbroker_ha_activation": ("gauge", "The activation sequence this broker went live with (or raised to)",
                                     view["activation"]),
        "amqpbroker_ha_zookeeper_connected": ("gauge", "1 while the ZooKeeper session is connected",
                                              int(zk["session"] == "CONNECTED")),
        "amqpbroker_ha_zookeeper_suspended_total": ("counter", "Times the ZooKeeper connection was lost",
                                                    zk["changes"]["SUSPENDED"]),
        "amqpbroker_ha_zookeeper_sessions_lost_total": ("counter", "Times the ZooKeeper session expired (or closed)",
                                                        zk["changes"]["LOST"]),
        "amqpbroker_ha_fenced_total": ("counter", "Times this broker stopped accepting while live (ZooKeeper in "
                                                  "doubt, a pause, the lease over)", view.get("fenced_total", 0)),
    }
    rep = view.get("replication")
    if rep is not None:   # the live broker's view of its backup
        out["amqpbroker_ha_backup_in_sync"] = (
            "gauge", "1 while the backup holds everything acknowledged (it may take over)", int(rep["in_sync"]))
        out["amqpbroker_ha_replication_lag_batches"] = (
            "gauge", "Store batches sent to the backup and not acknowledged yet", rep["lag_batches"])
        out["amqpbroker_ha_replication_lag_bytes"] = (
            "gauge", "Bytes of store batches sent to the backup and not acknowledged yet", rep["lag_bytes"])
        out["amqpbroker_ha_replication_lag_seconds"] = (
            "gauge", "Age of the oldest store batch the backup has not acknowledged", rep["lag_seconds"])
        out["amqpbroker_ha_alone_total"] = (
            "counter", "Times the live broker raised the activation to go on without its backup", rep["alone_total"])
        out["amqpbroker_ha_acknowledgements_held"] = (
            "gauge", "1 while nothing is acknowledged because this broker may not accept", int(rep["held"]))
    bk = view.get("backup")
    if bk is not None:    # this broker is the backup
        out["amqpbroker_ha_backup_in_sync"] = (
            "gauge", "1 while this backup holds everything acknowledged (it may take over)", int(bk["in_sync"]))
        if bk["lag_batches"] is not None:
            out["amqpbroker_ha_replication_lag_batches"] = (
                "gauge", "Store batches the live broker has framed that this backup has not committed",
                bk["lag_batches"])
        out["amqpbroker_ha_replication_lag_bytes"] = (
            "gauge", "Bytes of batches received that this backup has not committed yet", bk["lag_bytes"])
        out["amqpbroker_ha_catch_ups_total"] = (
            "counter", "Times this backup was caught up (a store copy or batches only)",
            sum(bk["catch_ups"].values()))
    return out


def health(view: dict) -> tuple[bool, str]:
    """Whether a broker of a pair is healthy: live and accepting, or a backup that
    keeps a copy (its AMQP listener is closed on purpose)."""
    status = view.get("status")
    if status == "live":
        return bool(view.get("accepting")), "live" if view.get("accepting") else "live, not accepting now"
    if status == "backup":
        return True, "backup" + (" (in sync)" if (view.get("backup") or {}).get("in_sync") else "")
    return False, str(status)


class BackupApi:
    """The management listener of a broker that is not live: read-only."""

    def __init__(self, settings: Any, node: Any):
        from ..security.guard import AccessGuard
        from ..security.throttle import auth_throttle
        from ..security.users import UserStore
        from .auth import Authenticator

        self.settings = settings
        self.node = node
        users = UserStore({n: u.password for n, u in settings.users.items() if u.password is not None})
        # What the authenticator reads (management/auth.py): the same rules as the full API.
        self.managed = SimpleNamespace(access=AccessGuard(settings, None, None), users=users, ha=node)
        self.auth_throttle = auth_throttle(settings)
        self.http_auth_failures = 0
        self.authenticator = Authenticator(self)
        self.port: int | None = None
        self._server: Any = None
        self._task: asyncio.Task | None = None

    def build(self):
        from fastapi import Depends, FastAPI, Request
        from fastapi.responses import JSONResponse, Response

        from .admin import AdminError
        from .auth import Principal
        from .exposition import render, scalar
        from .request_guard import RequestGuard
        from .request_policy import HostPolicy

        m = self.settings.management
        app = FastAPI(title="amqpbroker management API (HA backup)", version="1", docs_url=None, redoc_url=None)
        app.add_middleware(RequestGuard, policy=HostPolicy(m.host, m.allowed_hosts))
        auth = Depends(self.authenticator)

        @app.exception_handler(AdminError)
        async def _admin_error(request: Request, exc: AdminError) -> JSONResponse:
            return JSONResponse({"error": exc.message}, status_code=exc.status)

        @app.get("/api/ha")
        async def get_ha(principal: Principal = auth) -> dict:
            return ha_view(self.managed)

        @app.get("/api/health")
        async def get_health(principal: Principal = auth) -> JSONResponse:
            ok, why = health(ha_view(self.managed))
            return JSONResponse({"healthy": ok, "status": why}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics(principal: Principal = auth) -> Response:
            figures = ha_figures(self.managed)
            body = render([scalar(name, kind, doc, value) for name, (kind, doc, value) in sorted(figures.items())])
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def elsewhere(path: str) -> JSONResponse:
            return JSONResponse({"error": "this broker is the pair's backup: only /api/ha, /api/health and "
                                          "/metrics answer here (the live broker has the full API)"},
                                status_code=503)

        return app

    async def start(self) -> None:
        import uvicorn

        m = self.settings.management
        if not m.enabled:
            return
        family = socket.AF_INET6 if ":" in m.host else socket.AF_INET
        try:
            sock = socket.create_server((m.host, m.port), family=family, backlog=64)
        except OSError as exc:
            # Not fatal for a backup: it keeps its copy; the live broker's port may be this one.
            log.error("management listener on %s:%d: %s (two brokers of a pair on one machine need "
                      "their own [management] port: docs/ha.md)", m.host, m.port, exc.strerror or exc)
            return
        sock.setblocking(False)
        config = uvicorn.Config(self.build(), loop="none", lifespan="off", log_config=None, access_log=False,
                                ws="none", server_header=False, timeout_graceful_shutdown=1,
                                ssl_certfile=str(m.cert_file) if m.cert_file else None,
                                ssl_keyfile=str(m.key_file) if m.key_file else None)
        server = self._server = embedded_server(config)
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                log.error("management listener (backup) failed to start: %s", self._task.exception())
                self._server = None
                return
            await asyncio.sleep(0.005)
        self.port = sock.getsockname()[1]
        log.info("management listening on %s:%d (%s, backup: /api/ha, /api/health, /metrics)", m.host, self.port,
                 "https" if m.cert_file else "http")

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 5.0)
        except (asyncio.TimeoutError, Exception):   # noqa: BLE001 — stopping regardless
            self._task.cancel()
