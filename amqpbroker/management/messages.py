"""Message-level operations on a running broker: browsing a queue's waiting
messages, moving them (replay of a dead-letter queue, the general move), and the
hot backup of the store.

Browsing and moving run on the broker's loop a slice per loop turn (core/moves.py
SLICE; browsing the same), yielding in between: a replay of a million messages
delays AMQP traffic by a slice, never by the whole replay.  Each moved message's
removal and arrival go into the same store batch (core/moves.py).  A move or replay
is a job (management/jobs.py): it runs whether or not its HTTP client waits, reports
its progress and can be cancelled.  Selectors have the AMQP side's length limit
(limits.max_selector_length) and an evaluation budget (core/selectors/like.py).  The backup runs
`amqpbroker store backup` (store/tool.py) in a child process, waited for in the
management worker thread (`off_loop`): LMDB's copy runs in one read transaction
while the writer goes on, and the broker's own process opens no second handle on
its environment (LMDB forbids two in one process).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..core.browsing import message_view
from ..core.message import Message
from ..core.moves import Move, MoveRefused, compile_filter, selects
from ..core.selectors import TURN_BUDGET, SelectorBudgetExceeded, spent
from ..store.base import write_refusal
from .admin import Admin, AdminError, Conflict, NotFound
from .jobs import Job, Jobs

log = logging.getLogger("amqpbroker.admin")

BROWSE_SLICE = 256           # entries examined per loop turn while browsing (or TURN_BUDGET selector steps)
MAX_BROWSE = 1000            # messages per page at most
BACKUP_TIMEOUT = 3600.0      # seconds the copy and its check may take


class MessageOps:
    def __init__(self, admin: Admin):
        self.admin = admin
        self.managed = admin.managed
        self.broker = admin.broker
        self.jobs = Jobs()

    def _selector(self, text: str | None) -> Any:
        try:
            return compile_filter(text, self.managed.settings.limits.max_selector_length)
        except ValueError as exc:
            raise AdminError(str(exc)) from None

    # ------------------------------------------------------------------ browsing

    async def browse(self, name: str, *, offset: int = 0, limit: int = 50,
                     selector: str | None = None) -> dict:
        """A page of a queue's waiting messages (ready, scheduled, paged) in sequence
        order; those a consumer holds are counted in `unacked`, not listed.  Changes
        nothing: no delivery, no delivery-count, no body kept in memory."""
        q = self.admin.queue(name)
        sel = self._selector(selector)
        out: list[dict] = []
        cursor = skipped = 0
        while len(out) < limit and not q.deleted:
            chunk = q.waiting_after(cursor, BROWSE_SLICE, scheduled=True)
            if not chunk:
                break
            started = spent()       # selector steps: at most TURN_BUDGET a slice (and one evaluation)
            for entry, state in chunk:
                if spent() - started > TURN_BUDGET:
                    break           # the rest of the chunk at the next turn, from `cursor`
                cursor = entry.seq
                msg = q.peek_body(entry)
                if msg is None:
                    continue
                fresh = Message(msg.raw, arrival=msg.arrival)   # decoded here, not on the live message
                try:
                    if sel is not None and not selects(sel, fresh, entry.delivery_count):
                        continue
                except SelectorBudgetExceeded as exc:
                    raise AdminError(f"message seq={entry.seq}: {exc}") from None
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(message_view(entry, fresh, state))
                if len(out) >= limit:
                    break
            await asyncio.sleep(0)   # the next slice at the next loop turn
        return {"queue": name, "offset": offset, "limit": limit, "selector": selector,
                "depth": q.depth, "unacked": q.acquired, "messages": out}

    # ------------------------------------------------------------------ moving

    def start_move(self, name: str, *, to: str | None, selector: str | None, limit: int,
                   replay: bool, who: str, permit: Any = None) -> Job:
        """Start moving (or replaying) a queue's waiting messages: the job, running."""
        q = self.admin.queue(name)
        sel = self._selector(selector)
        if not replay and not to:
            raise AdminError("'to' is required: the address to move the messages to")
        kind = "replay" if replay else "move"

        def make(op: str) -> Move:
            try:
                return Move(self.broker, q, to=to or None, replay=replay, selector=sel, limit=limit,
                            permit=permit, op=op)
            except MoveRefused as exc:
                raise (NotFound if "no queue or exchange" in str(exc) or "no destination" in str(exc)
                       else AdminError)(str(exc)) from None

        job = self.jobs.start(kind, name, who, make, self._run)
        log.info("admin: %s of queue '%s' started by %s as job %s (to %s, selector %s, limit %s)", kind, name,
                 who, job.id, to or "each message's origin", selector or "none", limit or "none")
        return job

    async def _run(self, job: Job) -> None:
        """A move a slice per loop turn; over once every moved message's batch committed."""
        move = job.move
        started = time.monotonic()
        while True:
            refusal = write_refusal(self.managed.store)
            if refusal is not None:
                move.cancel(refusal)
                break
            if move.step():
                break
            await asyncio.sleep(0)
        await self.admin.synced()
        view = move.report.view()
        log.info("admin: %s of queue '%s' by %s (job %s): %d moved (%s), %d skipped%s in %.1f s", job.kind,
                 job.queue, job.who, job.id, view["moved"],
                 ", ".join(f"{k}: {v}" for k, v in view["destinations"].items()) or "-", view["skipped"],
                 f", stopped: {view['stopped']}" if view["stopped"] else "", time.monotonic() - started)

    # ------------------------------------------------------------------ backup

    async def backup(self, dest: str, who: str) -> dict:
        """A consistent, compacted copy of the running broker's store in `dest` (a new
        or empty directory on the broker's host), checked."""
        store = self.managed.store
        if not store.persistent:
            raise Conflict("the broker runs without a store: nothing to back up")
        problem = destination_problem(dest)
        if problem is not None:
            raise AdminError(f"dest: {problem}")
        path = Path(dest)
        try:
            used = path.exists() and (not path.is_dir() or any(path.iterdir()))
        except OSError as exc:   # a component that is a file, no permission, a loop
            raise AdminError(f"dest: cannot use {dest!r}: {exc.strerror or exc}") from None
        if used:
            raise Conflict(f"{dest} exists and is not an empty directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AdminError(f"dest: cannot create {dest!r}: {exc.strerror or exc}") from None
        source = getattr(store, "path", None) or self.managed.settings.data_dir / "store"
        log.info("admin: backup of the store to %s started by %s", dest, who)
        started = time.monotonic()
        done = await self.admin.off_loop(_run_backup, str(source), dest)
        took = time.monotonic() - started
        if done.returncode != 0:
            log.error("admin: backup to %s failed (exit %d): %s", dest, done.returncode, done.stderr.strip())
            raise AdminError(f"backup failed: {done.stderr.strip() or done.stdout.strip()}", 500)
        log.info("admin: backup of the store to %s by %s done in %.1f s", dest, who, took)
        return {"dest": dest, "seconds": round(took, 3), "whole": "result: whole" in done.stdout,
                "bytes": _size(path / "data.mdb"), "output": done.stdout.strip().splitlines()}


NAME_MAX = 255      # bytes of one path component (Linux)
PATH_MAX = 4095     # bytes of a whole path, without its terminating NUL


def destination_problem(dest: str) -> str | None:
    """Why `dest` cannot be a backup destination, before the file system is asked
    (a NUL or an over-long name would raise in the middle of the request)."""
    if "\x00" in dest:
        return "a path cannot contain a NUL character"
    if not dest or not dest.startswith("/"):
        return f"must be an absolute path on the broker's host, not {dest!r}"
    encoded = dest.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX:
        return f"the path is longer than {PATH_MAX} bytes ({len(encoded)})"
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX:
        return f"a name in the path is longer than {NAME_MAX} bytes ({longest})"
    return None


def _run_backup(source: str, dest: str) -> subprocess.CompletedProcess:
    """`amqpbroker store backup` in a child (worker thread: it only waits)."""
    return subprocess.run([sys.executable, "-m", "amqpbroker.cli", "store", "backup", dest, "--data-dir", source],
                          capture_output=True, text=True, timeout=BACKUP_TIMEOUT)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
