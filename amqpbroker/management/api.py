"""The management REST API (FastAPI), the console's static files and /metrics.

Every endpoint is `async def`: it runs on the broker's event loop, between
protocol events, so it reads and changes broker state without locks; what visits
every queue does so a slice at a time, and sorting, rendering and JSON-encoding big
answers happen in the worker thread (service.py, pacing.py).  Errors are JSON
`{"error": "..."}` with a 4xx status.  OpenAPI at /openapi.json, docs at /docs.

Every request first passes `RequestGuard` (request_guard.py: Host against DNS rebinding; Origin and
Content-Type of changes against cross-site requests: request_policy.py), then
authentication (auth.py).
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.limits import Overflow, QueueLimits
from .admin import AdminError
from .auth import Principal
from .docs_ui import add_api_docs
from ..core.durations import parse_duration
from .cluster import cluster_view
from .ha import ha_view
from .exposition import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .listing import DEFAULT_LIMIT, MAX_LIMIT, next_link
from .message_api import add_message_routes
from .request_guard import RequestGuard
from .request_policy import HostPolicy

if TYPE_CHECKING:
    from .port import ApiOperations

log = logging.getLogger("amqpbroker.management")

STATIC = Path(__file__).parent / "static"
CONSOLE_FILES = {"index.html": "text/html; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
                 "console.css": "text/css; charset=utf-8"}
GZIP_MIN_BYTES = 64 * 1024          # smaller answers are sent as they are
JSON_INLINE_ITEMS = 200             # bigger lists are encoded in the worker thread
JSON_CHUNK_ITEMS = 200              # … a chunk per C call, so the loop gets the GIL in between
SEND_CHUNK_BYTES = 256 * 1024       # bigger answers are written a chunk at a time


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


class LimitsOut(BaseModel):
    max_depth: int
    max_bytes: int
    overflow: str


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
    limits: LimitsOut | None = Field(None, description="max_depth, max_bytes (0: none) and overflow; null: no limits")
    overflow_rejected_total: int = Field(0, description="transfers rejected: the queue was full (overflow reject)")
    overflow_dropped_total: int = Field(0, description="messages dropped or dead-lettered from the head (drop-head)")
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
    # Queue limits (docs/operations.md "Queue limits and overflow"); none set: a
    # [[queue_limits]] pattern's.  Kept with a durable queue across restarts.
    max_depth: int | None = Field(None, ge=0)
    max_bytes: int | None = Field(None, ge=0)
    overflow: Literal["block", "reject", "drop-head"] | None = None

    def queue_limits(self) -> QueueLimits | None:
        if self.max_depth is None and self.max_bytes is None and self.overflow is None:
            return None
        return QueueLimits(self.max_depth or 0, self.max_bytes or 0, Overflow(self.overflow or "block"))


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
    addresses: list[str] = Field([], description="the addresses its links attach to (those the asker may "
                                                 "see, without manage on '#')")


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
    alarms: list[str] = Field([], description="raised alarms (memory, disk): producers get no new credit")
    user: str | None = None


class MemoryAlarmOut(BaseModel):
    raised: bool
    used: int | None = Field(description="the broker process's RSS, bytes (null before the first reading)")
    limit: int | None = Field(description="the high watermark, bytes: the alarm is raised above it")
    clear_below: int | None = Field(description="a raised alarm clears below this many bytes")
    available: int | None = Field(description="physical memory, or the cgroup's limit when lower")
    basis: Literal["physical", "cgroup", "absolute"]
    high_watermark: float
    high_watermark_absolute: int | None
    raised_total: int


class DiskAlarmOut(BaseModel):
    enabled: bool = Field(description="false without a store (nothing is written)")
    raised: bool
    free: int | None = Field(description="free bytes on the data dir's filesystem")
    limit: int = Field(description="disk_free_limit: the alarm is raised below it")
    clear_from: int = Field(description="a raised alarm clears from this many free bytes")
    raised_total: int


class AlarmsOut(BaseModel):
    blocking: bool = Field(description="an alarm is raised: producers get no new credit, consumers drain")
    reasons: list[str]
    memory: MemoryAlarmOut
    disk: DiskAlarmOut
    check_interval: float
    producers_held: int = Field(0, description=(
        "producer links given no credit now: by a memory or disk alarm, by a queue with overflow block that has "
        "no room for them (credit is shared in proportion to room), or behind anonymous-relay transfers waiting "
        "for room in such a queue"))


class AlarmsIn(BaseModel):
    """New thresholds, until the broker restarts; fields left out keep their values."""
    memory_high_watermark: float | None = Field(
        None, gt=0, le=1, description="fraction of the memory available; drops the absolute watermark "
                                      "unless that is given too")
    memory_high_watermark_absolute: int | None = Field(
        None, ge=1, description="bytes; replaces the fraction (null: back to the fraction)")
    disk_free_limit: int | None = Field(None, ge=0, description="bytes; 0 turns the disk alarm off")


def accepts_gzip(header: str) -> bool:
    for part in header.lower().split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


# ---------------------------------------------------------------------- the app

def build_app(ops: "ApiOperations") -> FastAPI:
    admin = ops.admin
    app = FastAPI(title="amqpbroker management API", version="1",
                  description="Queues, exchanges, bindings, subscriptions and connections of a "
                              "running amqpbroker (docs/operations.md).",
                  responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody},
                             403: {"model": ErrorBody}, 404: {"model": ErrorBody},
                             409: {"model": ErrorBody}, 415: {"model": ErrorBody},
                             421: {"model": ErrorBody}},
                  docs_url=None, redoc_url=None)     # served from here, not a CDN: docs_ui.py
    add_api_docs(app)
    m = ops.settings.management
    app.add_middleware(RequestGuard, policy=HostPolicy(m.host, m.allowed_hosts))
    auth = Depends(ops.authenticator)

    async def encoded_text(request: Request, body: bytes) -> Response:
        headers = {"Vary": "Accept-Encoding"}
        if len(body) >= GZIP_MIN_BYTES and accepts_gzip(request.headers.get("accept-encoding", "")):
            body = await ops.off_loop(gzip.compress, body, 6)       # zlib lets go of the GIL
            headers["Content-Encoding"] = "gzip"
        return _body_response(body, METRICS_CONTENT_TYPE, headers)

    async def json_list(items: list[dict], headers: dict[str, str]) -> Response:
        """A JSON array, the way FastAPI writes one, encoded off the loop when long (the
        views are plain dicts: the worker thread reads nothing live)."""
        if len(items) <= JSON_INLINE_ITEMS:
            body = _json_bytes(items)
        else:
            body = await ops.off_loop(_json_chunks, items)
        return _body_response(body, "application/json", headers)

    @app.exception_handler(AdminError)
    async def _admin_error(request: Request, exc: AdminError) -> JSONResponse:
        if exc.status != 401:   # (failed authentications have their own lines: auth.py)
            log.info("management API: %s %s refused (%d): %s", request.method, request.url.path,
                     exc.status, exc.message)
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
        log.info("management API: %s %s refused (422): %s", request.method, request.url.path,
                 "; ".join(parts) or "invalid request")
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
        return {**await admin.overview(), "user": principal.user}

    @app.get("/api/alarms", response_model=AlarmsOut, tags=["broker"],
             summary="Memory and disk alarms: state, readings and thresholds")
    async def get_alarms(principal: Principal = auth) -> dict:
        return admin.alarms_view()

    @app.get("/api/ha", tags=["broker"],
             summary="The HA pair: role, status, activation, ZooKeeper session, backup and replication lag")
    async def get_ha(principal: Principal = auth) -> dict:
        return ha_view(admin.managed)

    @app.get("/api/cluster", tags=["broker"],
             summary="The cluster as this node sees it: nodes, live or not, slots, the map's epoch, "
                     "forwarded links and what waits on other nodes")
    async def get_cluster(principal: Principal = auth) -> dict:
        return cluster_view(admin.managed)

    @app.put("/api/alarms", response_model=AlarmsOut, tags=["broker"],
             summary="Change the alarm thresholds at run time (as rabbitmqctl set_vm_memory_high_watermark / "
                     "set_disk_free_limit); not kept over a restart")
    async def put_alarms(body: AlarmsIn, principal: Principal = auth) -> dict:
        principal.require_all()
        return admin.set_alarms(body.model_dump(exclude_unset=True), principal.user or "(loopback)")

    @app.get("/metrics", tags=["broker"], response_class=Response,
             summary="Prometheus metrics (text exposition format): broker-wide figures and the "
                     "series of the deepest queues ([management] metrics_queue_limit)")
    async def metrics(request: Request, principal: Principal = auth) -> Response:
        _require_all(principal, "the metrics")
        return await encoded_text(request, await ops.metrics.main_text())

    @app.get("/metrics/per-object", tags=["broker"], response_class=Response,
             summary="Prometheus series of every queue and named subscription (or those matching `name`)")
    async def metrics_per_object(
            request: Request,
            name: str | None = Query(None, description="glob (orders.*) or prefix of queue / subscription names"),
            principal: Principal = auth) -> Response:
        _require_all(principal, "the metrics")
        return await encoded_text(request, await ops.metrics.per_object_text(name))

    # ------------------------------------------------------------------ exchanges

    @app.get("/api/exchanges", response_model=list[ExchangeOut], tags=["exchanges"])
    async def list_exchanges(principal: Principal = auth) -> list[dict]:
        return [e for e in admin.exchanges() if principal.sees(e["name"])]

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

    @app.get("/api/queues", response_model=list[QueueOut], tags=["queues"],
             summary="A page of queues; the number matching in X-Total-Count, the next page in Link")
    async def list_queues(
            request: Request,
            offset: int = Query(0, ge=0),
            limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
            name: str | None = Query(None, description="glob (orders.*) or prefix (orders.)"),
            sort: Literal["name", "depth"] = Query("name", description="name, or depth (deepest first)"),
            subscription: bool | None = Query(None, description="only (true) or no (false) subscription queues"),
            principal: Principal = auth) -> Response:
        total, views = await admin.queue_page(offset=offset, limit=limit, pattern=name, sort=sort,
                                              subscription=subscription, visible=principal.visible())
        headers = {"X-Total-Count": str(total)}
        link = next_link(request.url.path, dict(request.query_params), total, offset, limit)
        if link is not None:
            headers["Link"] = link
        return await json_list(views, headers)

    @app.post("/api/queues", response_model=QueueOut, status_code=201, tags=["queues"])
    async def create_queue(body: QueueIn, principal: Principal = auth) -> dict:
        principal.require(body.name)
        out = admin.create_queue(body.name, durable=body.durable,
                                 max_delivery_attempts=body.max_delivery_attempts, limits=body.queue_limits())
        await admin.synced()
        return out

    @app.post("/api/queues/{name:path}/purge", response_model=PurgeOut, tags=["queues"])
    async def purge_queue(name: str, principal: Principal = auth) -> dict:
        principal.require(name)
        n = admin.purge(name)
        await admin.synced()
        return {"queue": name, "purged": n}

    add_message_routes(app, ops, auth)   # before GET /api/queues/{name}: its path would take theirs

    @app.get("/api/queues/{name:path}", response_model=QueueOut, tags=["queues"])
    async def get_queue(name: str, principal: Principal = auth) -> dict:
        queue = admin.queue(name)
        sub = admin.registry.by_queue.get(name)
        principal.require(admin.subscription_state(sub).topic if sub is not None else name)
        return admin.queue_view(queue)

    @app.delete("/api/queues/{name:path}", response_model=DeletedOut, tags=["queues"])
    async def delete_queue(name: str, force: bool = False, principal: Principal = auth) -> dict:
        principal.require(name)
        dropped = admin.delete_queue(name, force=force)
        await admin.synced()
        return {"deleted": name, "messages_dropped": dropped}

    # ------------------------------------------------------------------ bindings

    @app.get("/api/bindings", response_model=list[BindingOut], tags=["bindings"])
    async def list_bindings(principal: Principal = auth) -> list[dict]:
        bindings = admin.bindings()
        if principal.sees_all:
            return bindings
        visible = _visible_queues(admin, principal)
        return [b for b in bindings if visible(b["queue"])]

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
        return [s for s in admin.subscriptions(seconds, abandoned_only=abandoned) if principal.sees(s["topic"])]

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
        views = admin.connections()
        if principal.sees_all:
            return views
        # A connection is listed to whom one of its addresses belongs, with those only.
        out = []
        for view in views:
            mine = [a for a in view["addresses"] if principal.may(a)]
            if mine:
                out.append({**view, "addresses": mine})
        return out

    @app.delete("/api/connections/{conn_id}", response_model=ConnectionOut, tags=["connections"],
                summary="Close a connection with amqp:connection:forced")
    async def close_connection(conn_id: int, principal: Principal = auth) -> dict:
        principal.require_all()
        return admin.close_connection(conn_id)

    return app


def _require_all(principal: Principal, what: str) -> None:
    """What covers every queue (the metrics) needs `manage` on '#'."""
    if not principal.sees_all:
        raise AdminError(f"user '{principal.user}' may not read {what}: they cover every queue "
                         "(manage on '#' is needed)", 403)


def _visible_queues(admin: Any, principal: Principal) -> Any:
    """Whether a queue name is visible to `principal`: a subscription's queue by its topic."""
    topics = {name: admin.subscription_state(sub).topic for name, sub in admin.registry.by_queue.items()}
    return lambda name: principal.may(topics.get(name, name))


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _json_chunks(items: list[dict]) -> bytes:
    parts = [_json_bytes(items[i:i + JSON_CHUNK_ITEMS])[1:-1] for i in range(0, len(items), JSON_CHUNK_ITEMS)]
    return b"[" + b",".join(parts) + b"]"


def _body_response(body: bytes, media_type: str, headers: dict[str, str]) -> Response:
    """A big body goes out a chunk at a time: handed over whole, the HTTP layer and the
    transport copy all 20 MB in single calls on the loop (~10 ms each)."""
    if len(body) <= SEND_CHUNK_BYTES:
        return Response(body, media_type=media_type, headers=headers)

    async def chunks() -> AsyncIterator[bytes]:
        view = memoryview(body)
        for i in range(0, len(body), SEND_CHUNK_BYTES):
            yield bytes(view[i:i + SEND_CHUNK_BYTES])

    return StreamingResponse(chunks(), media_type=media_type,
                             headers={**headers, "Content-Length": str(len(body))})


def _static(name: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=CONSOLE_FILES[name],
                    headers={"Cache-Control": "no-cache"})
