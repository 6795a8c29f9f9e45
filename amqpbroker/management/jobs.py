"""Long operations of the management API as job resources: a move or a replay runs
on the broker's loop a slice per turn (core/moves.py) whatever the HTTP client does;
the request that starts it answers with the job (at once, or once it ended when the
client asks to `wait`), `GET /api/jobs/{id}` reports its progress and `DELETE
/api/jobs/{id}` cancels it between two slices (what moved stays moved).

One job at a time per source queue: two moves walking the same queue would each
publish a copy of a message only one of them can take out.  Finished jobs are kept
for a while (KEEP of them) so their report can still be read.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from .admin import Conflict, NotFound

KEEP = 100            # finished jobs kept for GET /api/jobs
# running; done (went through); stopped (ended early: the report's `stopped` says why: a
# full destination, a store refusing writes, a selector over its budget); cancelled
# (DELETE); failed (an error: `error`).
RUNNING, DONE, STOPPED, CANCELLED, FAILED = "running", "done", "stopped", "cancelled", "failed"


@dataclass
class Job:
    id: str
    kind: str                        # move | replay
    queue: str
    who: str
    move: Any                        # core/moves.Move
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    state: str = RUNNING
    error: str | None = None
    cancelled_by: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: Any = None                 # the loop keeps only a weak reference to a task: this one

    @property
    def href(self) -> str:
        return f"/api/jobs/{self.id}"

    def view(self) -> dict:
        report = self.move.report.view()
        return {"id": self.id, "kind": self.kind, "queue": self.queue, "state": self.state, "who": self.who,
                "started_at": self.started_at, "finished_at": self.finished_at, "error": self.error,
                "progress": {"examined": report["examined"], "total": report["total"]},
                "report": report, "href": self.href}


class Jobs:
    def __init__(self) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count(1)

    def start(self, kind: str, queue: str, who: str, make: Callable[[str], Any],
              run: Callable[[Job], Awaitable[None]]) -> Job:
        """A new job: `make(job_id)` builds its Move, `run(job)` drives it (a task)."""
        busy = self.running_on(queue)
        if busy is not None:
            raise Conflict(f"a {busy.kind} of queue '{queue}' is running ({busy.href}); "
                           "wait for it or cancel it first")
        job_id = f"{kind}-{next(self._ids)}"
        job = Job(job_id, kind, queue, who, make(job_id))
        self._jobs[job_id] = job
        self._trim()
        job.task = asyncio.get_running_loop().create_task(self._drive(job, run))
        return job

    async def _drive(self, job: Job, run: Callable[[Job], Awaitable[None]]) -> None:
        try:
            await run(job)
            job.state = (CANCELLED if job.cancelled_by else STOPPED if job.move.report.stopped else DONE)
        except Exception as exc:   # noqa: BLE001 - a job's failure is its report, not the loop's
            job.state, job.error = FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            job.finished_at = time.time()
            job.done.set()

    def running_on(self, queue: str) -> Job | None:
        return next((j for j in self._jobs.values() if j.queue == queue and j.state == RUNNING), None)

    def get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job '{job_id}'")
        return job

    def all(self) -> list[Job]:
        return list(self._jobs.values())

    def cancel(self, job_id: str, who: str) -> Job:
        job = self.get(job_id)
        if job.state == RUNNING and job.cancelled_by is None:
            job.cancelled_by = who
            job.move.cancel(f"cancelled by {who}")
        return job

    @staticmethod
    async def wait(job: Job, seconds: float) -> None:
        """Until the job ended or `seconds` passed (the job goes on either way)."""
        if seconds > 0 and job.state == RUNNING:
            try:
                await asyncio.wait_for(asyncio.shield(job.done.wait()), seconds)
            except asyncio.TimeoutError:
                pass

    def _trim(self) -> None:
        finished = [k for k, j in self._jobs.items() if j.state != RUNNING]
        for key in finished[:max(0, len(finished) - KEEP)]:
            del self._jobs[key]

