"""The management API's message endpoints: browsing a queue's messages, move,
replay (docs/operations.md "Dead-letter replay and move", "Browsing messages") and
the hot backup ("Hot backup").  Registered by api.build_app; the work is in
messages.py, the decisions in core/moves.py and core/browsing.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from .auth import Principal
from .messages import MAX_BROWSE

if TYPE_CHECKING:
    from .service import Operations


class MoveIn(BaseModel):
    """A move or replay of a queue's waiting messages (docs/operations.md)."""
    to: str | None = Field(None, min_length=1, description="destination address; replay: each message's "
                                                           "dead-letter origin when left out")
    selector: str | None = Field(None, description="JMS selector: only the messages it accepts")
    limit: int = Field(0, ge=0, description="at most this many (0: all)")


class MoveOut(BaseModel):
    queue: str
    moved: int
    examined: int
    skipped: int = Field(description="chosen but left in place (see skip_reasons)")
    destinations: dict[str, int]
    skip_reasons: dict[str, int]
    stopped: str | None = Field(description="why the move ended before the queue's end")


class BodyPreviewOut(BaseModel):
    type: str
    bytes: int | None = None
    preview: Any = None
    truncated: bool = False
    error: str | None = None


class MessageOut(BaseModel):
    sequence: int
    state: Literal["ready", "scheduled", "paged"]
    size: int = Field(description="encoded size of the whole message, bytes")
    delivery_count: int
    redelivered: bool
    header: dict[str, Any]
    properties: dict[str, Any] | None
    application_properties: dict[str, Any] | None
    message_annotations: dict[str, Any] | None
    body: BodyPreviewOut


class MessagesOut(BaseModel):
    queue: str
    offset: int
    limit: int
    selector: str | None
    depth: int
    unacked: int = Field(description="held by consumers: counted, not listed")
    messages: list[MessageOut]


class BackupIn(BaseModel):
    dest: str = Field(min_length=1, description="a new or empty directory on the broker's host (absolute path)")


class BackupOut(BaseModel):
    dest: str
    seconds: float
    whole: bool
    bytes: int
    output: list[str]



def add_message_routes(app: FastAPI, ops: "Operations", auth: Any) -> None:
    @app.get("/api/queues/{name:path}/messages", response_model=MessagesOut, tags=["messages"],
             summary="Browse a queue's waiting messages (nothing is delivered or changed)")
    async def browse_messages(
            name: str, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=MAX_BROWSE),
            selector: str | None = Query(None, description="JMS selector"),
            principal: Principal = auth) -> dict:
        principal.require(name)
        return await ops.messages.browse(name, offset=offset, limit=limit, selector=selector)

    @app.post("/api/queues/{name:path}/move", response_model=MoveOut, tags=["messages"],
              summary="Move waiting messages to another address, each atomically")
    async def move_messages(name: str, body: MoveIn, principal: Principal = auth) -> dict:
        principal.require(name)
        if body.to is not None:
            principal.require(body.to)
        return await ops.messages.move(name, to=body.to, selector=body.selector, limit=body.limit,
                                       replay=False, who=principal.user or "(loopback)")

    @app.post("/api/queues/{name:path}/replay", response_model=MoveOut, tags=["messages"],
              summary="Send dead-lettered messages back to their origin (or to `to`), without the "
                      "dead-letter annotations")
    async def replay_messages(name: str, body: MoveIn | None = None, principal: Principal = auth) -> dict:
        body = body or MoveIn()
        principal.require(name)
        if body.to is not None:
            principal.require(body.to)
        return await ops.messages.move(name, to=body.to, selector=body.selector, limit=body.limit,
                                       replay=True, who=principal.user or "(loopback)", permit=principal.may)

    @app.post("/api/reload", tags=["broker"],
              summary="Live reload: re-read the configuration file (users, ACLs, expiry policies, queue "
                      "limits); links that lost their permission are detached")
    async def reload_config(
            allow_open: bool = Query(False, description="take a file that turns access control off, removes "
                                                        "every user or gives anonymous more"),
            principal: Principal = auth) -> dict:
        principal.require("#")
        return await ops.reload(principal.user or "(loopback)", allow_open)

    @app.post("/api/backup", response_model=BackupOut, tags=["broker"],
              summary="Hot backup: a consistent compacted copy of the running broker's store, checked")
    async def backup(body: BackupIn, principal: Principal = auth) -> dict:
        principal.require("#")
        return await ops.messages.backup(body.dest, principal.user or "(loopback)")
