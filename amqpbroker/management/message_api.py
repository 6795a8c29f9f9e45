"""The management API's message endpoints: browsing a queue's messages, move,
replay as jobs (docs/operations.md "Dead-letter replay and move", "Browsing
messages") and the hot backup ("Hot backup").  Registered by api.build_app; the work
is in messages.py and jobs.py, the decisions in core/moves.py and core/browsing.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Query, Response
from pydantic import BaseModel, Field

from .auth import Principal
from .messages import MAX_BROWSE

if TYPE_CHECKING:
    from .port import MessageOperations


class MoveIn(BaseModel):
    """A move or replay of a queue's waiting messages (docs/operations.md)."""
    to: str | None = Field(None, min_length=1, description="destination address; replay: each message's "
                                                           "dead-letter origin when left out")
    selector: str | None = Field(None, description="JMS selector: only the messages it accepts")
    limit: int = Field(0, ge=0, description="at most this many (0: all)")


class MoveOut(BaseModel):
    queue: str
    total: int = Field(description="waiting in the queue when it started: what it may examine")
    moved: int
    examined: int
    skipped: int = Field(description="chosen but left in place (see skip_reasons)")
    destinations: dict[str, int]
    skip_reasons: dict[str, int]
    stopped: str | None = Field(description="why the move ended before the queue's end")


class ProgressOut(BaseModel):
    examined: int
    total: int


class JobOut(BaseModel):
    """A move or replay: it runs on the broker whatever the HTTP client does."""
    id: str
    kind: Literal["move", "replay"]
    queue: str
    state: Literal["running", "done", "stopped", "cancelled", "failed"] = Field(
        description="done: went through; stopped: ended early (report.stopped says why); cancelled: DELETE")
    who: str
    started_at: float
    finished_at: float | None
    error: str | None
    progress: ProgressOut
    report: MoveOut
    href: str


WAIT = Query(0.0, ge=0, le=300, description="seconds to wait for the job to end before answering "
                                             "(202 while it runs, 200 once it ended)")


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



def add_message_routes(app: FastAPI, ops: "MessageOperations", auth: Any) -> None:
    @app.get("/api/queues/{name:path}/messages", response_model=MessagesOut, tags=["messages"],
             summary="Browse a queue's waiting messages (nothing is delivered or changed)")
    async def browse_messages(
            name: str, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=MAX_BROWSE),
            selector: str | None = Query(None, description="JMS selector"),
            principal: Principal = auth) -> dict:
        principal.require(name)
        return await ops.messages.browse(name, offset=offset, limit=limit, selector=selector)

    async def started(job: Any, wait: float, response: Response) -> dict:
        await ops.messages.jobs.wait(job, wait)
        response.status_code = 202 if job.state == "running" else 200
        return job.view()

    @app.post("/api/queues/{name:path}/move", response_model=JobOut, tags=["messages"], status_code=202,
              summary="Move waiting messages to another address, each atomically (a job: GET or DELETE "
                      "/api/jobs/{id})")
    async def move_messages(name: str, body: MoveIn, response: Response, wait: float = WAIT,
                            principal: Principal = auth) -> dict:
        principal.require(name)
        if body.to is not None:
            principal.require(body.to)
        job = ops.messages.start_move(name, to=body.to, selector=body.selector, limit=body.limit,
                                      replay=False, who=principal.user or "(loopback)")
        return await started(job, wait, response)

    @app.post("/api/queues/{name:path}/replay", response_model=JobOut, tags=["messages"], status_code=202,
              summary="Send dead-lettered messages back to their origin (or to `to`), without the "
                      "dead-letter annotations (a job: GET or DELETE /api/jobs/{id})")
    async def replay_messages(response: Response, name: str, body: MoveIn | None = None, wait: float = WAIT,
                              principal: Principal = auth) -> dict:
        body = body or MoveIn()
        principal.require(name)
        if body.to is not None:
            principal.require(body.to)
        job = ops.messages.start_move(name, to=body.to, selector=body.selector, limit=body.limit,
                                      replay=True, who=principal.user or "(loopback)", permit=principal.may)
        return await started(job, wait, response)

    @app.get("/api/jobs", response_model=list[JobOut], tags=["messages"],
             summary="Moves and replays, running and recently ended (of the queues you may manage)")
    async def list_jobs(principal: Principal = auth) -> list[dict]:
        return [j.view() for j in ops.messages.jobs.all() if principal.may(j.queue)]

    @app.get("/api/jobs/{job_id}", response_model=JobOut, tags=["messages"], summary="A move or replay's progress")
    async def get_job(job_id: str, wait: float = WAIT, principal: Principal = auth) -> dict:
        job = ops.messages.jobs.get(job_id)
        principal.require(job.queue)
        await ops.messages.jobs.wait(job, wait)
        return job.view()

    @app.delete("/api/jobs/{job_id}", response_model=JobOut, tags=["messages"],
                summary="Cancel a move or replay between two slices (what moved stays moved)")
    async def cancel_job(job_id: str, principal: Principal = auth) -> dict:
        job = ops.messages.jobs.get(job_id)
        principal.require(job.queue)
        ops.messages.jobs.cancel(job_id, principal.user or "(loopback)")
        await ops.messages.jobs.wait(job, 5.0)
        return job.view()

    @app.post("/api/reload", tags=["broker"],
              summary="Live reload: re-read the configuration file (users, ACLs, expiry policies, queue "
                      "limits); links that lost their permission are detached")
    async def reload_config(
            allow_open: bool = Query(False, description="take a file that turns access control off, removes "
                                                        "every user or gives anonymous more"),
            principal: Principal = auth) -> dict:
        principal.require_all()
        return await ops.reload(principal.user or "(loopback)", allow_open)

    @app.post("/api/backup", response_model=BackupOut, tags=["broker"],
              summary="Hot backup: a consistent compacted copy of the running broker's store, checked")
    async def backup(body: BackupIn, principal: Principal = auth) -> dict:
        principal.require_all()
        return await ops.messages.backup(body.dest, principal.user or "(loopback)")
