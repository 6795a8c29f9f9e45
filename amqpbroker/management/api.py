"""The management REST API (FastAPI), the console's static files and /metrics.

Every endpoint is `async def`: it runs on the broker's event loop, between
protocol events, so it reads and changes broker state without locks.  Errors are
JSON `{"error": "..."}` with a 4xx status.  OpenAPI at /openapi.json, docs at /docs.

Authentication: with ACLs configured, HTTP basic with the broker's users and the
`manage` permission (changes: `manage` on the entity's name); without ACLs, only
loopback clients, unauthenticated.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import is_loopback
from ..security.acl import MANAGE
from .admin import AdminError
from .expiry import parse_duration

if TYPE_CHECKING:
    from .service import Operations

STATIC = Path(__file__).parent / "static"
CONSOLE_FILES = {"index.html": "text/html; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
                 "console.css": "text/css; charset=utf-8"}
AUTH_CACHE_SECONDS = 60.0


# ---------------------------------------------------------------------- models

class ErrorBody(BaseModel):
    error: str


class ExchangeOut(BaseModel):
    name: str
    type: str
    durable: bool
    builtin: bool
    bindings: int


class ExchangeIn(BaseModel):
    name: str = Field(min_length=1)
    type: Literal["direct", "topic", "fanout"] = "topic"
    durable: bool = True


class QueueOut(BaseModel):
    name: str
    durable: bool
    exclusivity: str
    lifetime: str
    depth: int = Field(description="messages held: ready, scheduled and delivered-but-unsettled")
    ready: int
    unacked: int
    bytes: int
    consumers: int
    browsers: int
    enqueued_total: int
    delivered_total: int
    acked_total: int
    expired_total: int
    dead_lettered_total: int
    enqueue_rate: float = Field(description="messages/s over the last sampling interval")
    deliver_rate: float
    ack_rate: float
    created_at: float
    last_delivered_at: float | None
    last_consumer_at: float | None
    subscription: bool = Field(description="the queue of a topic subscription")
    temporary: bool


class QueueIn(BaseModel):
    name: str = Field(min_length=1)
    durable: bool = True
    max_delivery_attempts: int | None = Field(None, ge=0)


class BindingOut(BaseModel):
    exchange: str
    queue: str
    key: str
    selector: str | None
    no_local: bool
    subscription: bool


class BindingIn(BaseModel):
    exchange: str = Field(min_length=1)
    queue: str = Field(min_length=1)
    key: str = ""


class SubscriptionOut(BaseModel):
    name: str
    namespace: str = Field(description="the client-id (container-id), or _global_")
    client_id: str | None
    global_: bool = Field(alias="global")
    durable: bool
    shared: bool
    named: bool = Field(description="false for a plain topic consumer's private subscription")
    queue: str
    topic: str
    exchange: str
    key: str
    selector: str | None
    no_local: bool
    consumers: int
    pending: int
    pending_bytes: int
    created_at: float
    last_delivered_at: float | None
    last_consumer_at: float | None = Field(description="last time a consumer attached or detached")
    idle_seconds: float | None = Field(description="seconds without a consumer; null while consumed")
    abandoned: bool = Field(description="durable, no consumer for at least `idle`")
    links: list[str]
    consumers_detached: int | None = None

    model_config = {"populate_by_name": True}


class ConnectionOut(BaseModel):
    id: int
    container_id: str | None
    user: str | None
    remote_address: str
    listener: str
    tls: bool
    sessions: int
    links: int
    consumers: int


class PurgeOut(BaseModel):
    queue: str
    purged: int


class DeletedOut(BaseModel):
    deleted: str
    messages_dropped: int | None = None


class OverviewOut(BaseModel):
    version: str
    container_id: str
    queues: int
    exchanges: int
    subscriptions: int
    connections: int
    links: int
    messages: int
    routed_total: int
    unroutable_total: int
    store_persistent: bool
    access_control: bool
    user: str | None = None


# ---------------------------------------------------------------------- auth

class Principal:
    def __init__(self, user: str | None, groups: frozenset[str], ops: "Operations"):
        self.user = user
        self.groups = groups
        self.ops = ops

    def require(self, name: str) -> None:
        """`manage` on this entity (only when ACLs are configured)."""
        guard = self.ops.server.access
        if guard.enabled and not guard.policy.allows(self.user, self.groups, MANAGE, name):
            raise AdminError(f"user '{self.user}' may not manage '{name}'", 403)


class _Unauthorized(AdminError):
    status = 401


def _authenticator(ops: "Operations"):
    cache: dict[str, float] = {}

    async def authenticate(request: Request) -> Principal:
        _same_origin(request)
        guard = ops.server.access
        if not guard.enabled:
            host = request.client.host if request.client else ""
            if not is_loopback(host):
                raise AdminError("without access control configured, the management API "
                                 "answers loopback clients only", 403)
            return Principal(None, frozenset(), ops)
        user, password = _basic(request)
        if user is None:
            if guard.policy.can_manage_any(None, ()):
                return Principal(None, frozenset(), ops)
            raise _Unauthorized("authentication required")
        token = hashlib.sha256(f"{user}\0{password}".encode()).hexdigest()
        now = time.monotonic()
        if cache.get(token, 0.0) < now:
            if not ops.server.users.verify_plain(user, password):
                ops.auth_failures += 1
                raise _Unauthorized("invalid user name or password")
            if len(cache) > 1000:
                cache.clear()
            cache[token] = now + AUTH_CACHE_SECONDS
        groups = guard.groups_of(user)
        if not guard.policy.can_manage_any(user, groups):
            raise AdminError(f"user '{user}' lacks the manage permission", 403)
        return Principal(user, groups, ops)

    return authenticate


def _same_origin(request: Request) -> None:
    """Changes from another web origin are refused (cross-site request forgery: a page
    elsewhere could post a form to the loopback API, or reuse the browser's cached
    basic credentials).  Scripts and the CLI send no Origin header."""
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return
    origin = request.headers.get("origin")
    if origin is None:
        return
    if urlsplit(origin).netloc != request.headers.get("host", ""):
        raise AdminError(f"cross-origin request from {origin} refused", 403)


def _basic(request: Request) -> tuple[str | None, str]:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None, ""
    try:
        user, _, password = base64.b64decode(value.strip()).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise _Unauthorized("malformed basic credentials") from None
    return user, password


# ---------------------------------------------------------------------- the app

def build_app(ops: "Operations") -> FastAPI:
    admin = ops.admin
    app = FastAPI(title="amqpbroker management API", version="1",
                  description="Queues, exchanges, bindings, subscriptions and connections of a "
                              "running amqpbroker (docs/operations.md).",
                  responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody},
                             403: {"model": ErrorBody}, 404: {"model": ErrorBody},
                             409: {"model": ErrorBody}})
    auth = Depends(_authenticator(ops))

    @app.exception_handler(AdminError)
    async def _admin_error(request: Request, exc: AdminError) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Basic realm="amqpbroker"'} if exc.status == 401 else None
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return JSONResponse({"error": "; ".join(parts) or "invalid request"}, status_code=422)

    # ------------------------------------------------------------------ console

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/console/")

    @app.get("/console/", include_in_schema=False)
    async def console_index(principal: Principal = auth) -> Response:
        return _static("index.html")

    @app.get("/console/{name}", include_in_schema=False)
    async def console_file(name: str) -> Response:
        if name not in CONSOLE_FILES:
            raise AdminError(f"no console file '{name}'", 404)
        return _static(name)

    # ------------------------------------------------------------------ overview, metrics

    @app.get("/api/overview", response_model=OverviewOut, tags=["broker"])
    async def overview(principal: Principal = auth) -> dict:
        return {**admin.overview(), "user": principal.user}

    @app.get("/metrics", tags=["broker"], response_class=Response,
             summary="Prometheus metrics (text exposition format)")
    async def metrics(principal: Principal = auth) -> Response:
        from .metrics import render
        body, content_type = render(ops)
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ exchanges

    @app.get("/api/exchanges", response_model=list[ExchangeOut], tags=["exchanges"])
    async def list_exchanges(principal: Principal = auth) -> list[dict]:
        return admin.exchanges()

    @app.post("/api/exchanges", response_model=ExchangeOut, status_code=201, tags=["exchanges"])
    async def create_exchange(body: ExchangeIn, principal: Principal = auth) -> dict:
        principal.require(body.name)
        out = admin.create_exchange(body.name, body.type, body.durable)
        await admin.synced()
        return out

    @app.delete("/api/exchanges/{name:path}", response_model=DeletedOut, tags=["exchanges"])
    async def delete_exchange(name: str, force: bool = False, principal: Principal = auth) -> dict:
        principal.require(name)
        admin.delete_exchange(name, force=force)
        await admin.synced()
        return {"deleted": name}

    # ------------------------------------------------------------------ queues

    @app.get("/api/queues", response_model=list[QueueOut], tags=["queues"])
    async def list_queues(principal: Principal = auth) -> list[dict]:
        return admin.queues()

    @app.post("/api/queues", response_model=QueueOut, status_code=201, tags=["queues"])
    async def create_queue(body: QueueIn, principal: Principal = auth) -> dict:
        principal.require(body.name)
        out = admin.create_queue(body.name, durable=body.durable,
                                 max_delivery_attempts=body.max_delivery_attempts)
        await admin.synced()
        return out

    @app.post("/api/queues/{name:path}/purge", response_model=PurgeOut, tags=["queues"])
    async def purge_queue(name: str, principal: Principal = auth) -> dict:
        principal.require(name)
        n = admin.purge(name)
        await admin.synced()
        return {"queue": name, "purged": n}

    @app.get("/api/queues/{name:path}", response_model=QueueOut, tags=["queues"])
    async def get_queue(name: str, principal: Principal = auth) -> dict:
        return admin.queue_view(admin.queue(name))

    @app.delete("/api/queues/{name:path}", response_model=DeletedOut, tags=["queues"])
    async def delete_queue(name: str, force: bool = False, principal: Principal = auth) -> dict:
        principal.require(name)
        dropped = admin.delete_queue(name, force=force)
        await admin.synced()
        return {"deleted": name, "messages_dropped": dropped}

    # ------------------------------------------------------------------ bindings

    @app.get("/api/bindings", response_model=list[BindingOut], tags=["bindings"])
    async def list_bindings(principal: Principal = auth) -> list[dict]:
        return admin.bindings()

    @app.post("/api/bindings", response_model=BindingOut, status_code=201, tags=["bindings"])
    async def create_binding(body: BindingIn, principal: Principal = auth) -> dict:
        principal.require(body.queue)
        out = admin.bind(body.exchange, body.queue, body.key)
        await admin.synced()
        return out

    @app.delete("/api/bindings", response_model=DeletedOut, tags=["bindings"])
    async def delete_binding(exchange: str, queue: str, key: str = "",
                             principal: Principal = auth) -> dict:
        principal.require(queue)
        admin.unbind(exchange, queue, key)
        await admin.synced()
        return {"deleted": f"{exchange} -> {queue} ({key})"}

    # ------------------------------------------------------------------ subscriptions

    @app.get("/api/subscriptions", response_model=list[SubscriptionOut], response_model_by_alias=True,
             tags=["subscriptions"])
    async def list_subscriptions(
            idle: str = Query("7d", description="no consumer for this long counts as abandoned (e.g. 90s, 12h, 7d)"),
            abandoned: bool = Query(False, description="only abandoned subscriptions"),
            principal: Principal = auth) -> list[dict]:
        try:
            seconds = parse_duration(idle)
        except ValueError as exc:
            raise AdminError(f"idle: {exc}") from None
        return admin.subscriptions(seconds, abandoned_only=abandoned)

    @app.delete("/api/subscriptions/{name:path}", response_model=SubscriptionOut,
                response_model_by_alias=True, tags=["subscriptions"],
                summary="Admin unsubscribe: delete a subscription and its backlog")
    async def delete_subscription(
            name: str, namespace: str | None = Query(None, description="client-id, or _global_"),
            durable: bool | None = None,
            force: bool = Query(False, description="detach attached consumers (amqp:resource-deleted)"),
            principal: Principal = auth) -> dict:
        sub = admin.find_subscription(name, namespace, durable)
        principal.require(admin.subscription_state(sub).topic)
        out = admin.delete_subscription(name, namespace, durable, force=force,
                                        reason=f"administrator {principal.user or '(loopback)'}")
        await admin.synced()
        return out

    # ------------------------------------------------------------------ connections

    @app.get("/api/connections", response_model=list[ConnectionOut], tags=["connections"])
    async def list_connections(principal: Principal = auth) -> list[dict]:
        return admin.connections()

    @app.delete("/api/connections/{conn_id}", response_model=ConnectionOut, tags=["connections"],
                summary="Close a connection with amqp:connection:forced")
    async def close_connection(conn_id: int, principal: Principal = auth) -> dict:
        principal.require("#")
        return admin.close_connection(conn_id)

    return app


def _static(name: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=CONSOLE_FILES[name],
                    headers={"Cache-Control": "no-cache"})
