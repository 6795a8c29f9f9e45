"""The live broker's side of replication: a listener for its backup, catching a
backup up (a store copy, or only the batches it lacks), the stream of sealed
batches, acknowledgements, and going on alone.

Installed as `LmdbStore.replica` (store/channel.py calls `framed` for every batch
frame it writes to its own writer, and `gate` before it runs commit callbacks).
Every choice is a row of core/ha.py's REPLICA_TABLE, carried out here:

* ATTACH: a backup proved the pair's secret and said hello — it marked its store
  incomplete before it did — with the position of its store.  If commits were
  waiting for it (it was in sync and went away: LOST), the activation sequence
  is raised first (RAISE), so that nothing is released without it while its old
  copy could still take over.  Then (CATCH_UP) `catch_up_plan` picks the batches
  it lacks from the window of recent batches (same lineage, its position inside
  the window), else a copy of the store: `Environment.copy` in a child process,
  whose read transaction starts after the batches not yet committed here were
  queued for it — the batches that follow replay a prefix it may hold already,
  which blind puts and deletes make harmless (store/batch.py).
* ACK: the backup's writer committed up to a number.  Once it has what was handed
  over when it attached, commits wait for it; once it has everything released,
  it is told it is in sync (SYNCED) and may take over.
* TIMEOUT / DETACH: a backup that commits wait for and that stopped answering, or
  went away, is given up after `backup_timeout`: the activation is raised in
  ZooKeeper first (so it can never take over with what it has), then in the
  store, and commits go on alone.  If the raise fails, the node is told
  (`on_raise_failed`: it stops accepting until ZooKeeper is back, core/ha.py
  LIVE_TABLE).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..config import HaConfig
from ..core.ha import BatchWindow, CatchUp, PeerAction, PeerState, ReplicaTracker, catch_up_plan
from ..store import writer as writer_proc
from . import wire
from .state import ACTIVATION_KEY

log = logging.getLogger("amqpbroker.ha")

CHECK_INTERVAL = 0.1   # seconds between looks at the backup's lag
COPY_SCRIPT = ("import lmdb, sys\n"
               "env = lmdb.open(sys.argv[1], readonly=True, max_dbs=16, lock=True, readahead=False)\n"
               "env.copy(sys.argv[2], compact=True)\n")


class _Link:
    """One backup connection."""

    def __init__(self, writer: asyncio.StreamWriter, peer: str):
        self.writer = writer
        self.peer = peer
        self.queued: list[bytes] | None = None     # batch frames held back while a copy goes out

    def send(self, data: bytes) -> None:
        if self.queued is not None:
            self.queued.append(data)
        elif not self.writer.is_closing():
            self.writer.write(data)


class ReplicationServer:
    def __init__(self, cfg: HaConfig, store: Any, loop: asyncio.AbstractEventLoop,
                 raise_activation: Callable[[], Awaitable[int | None]],
                 on_raise_failed: Callable[[str, bool], None], ssl_context: Any = None):
        self.cfg = cfg
        self.store = store
        self.loop = loop
        self.ssl_context = ssl_context
        self.tracker = ReplicaTracker(cfg.synchronous, cfg.backup_timeout)
        self.raise_activation = raise_activation   # → the new sequence; None: another broker moved it
        self.on_raise_failed = on_raise_failed     # (why, another broker is live)
        self.lineage = uuid.uuid4().hex[:12]       # this run's batch numbers
        self.window = BatchWindow(cfg.catch_up_window)
        self.window.start_at(store.batch)
        self.last_framed = store.batch - 1
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.link: _Link | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._raising: asyncio.Future | None = None
        self.synced_total = 0
        self.last_plan: CatchUp | None = None

    # ------------------------------------------------------------------ store hooks

    def framed(self, number: int, data: bytes) -> None:
        """A batch frame on its way to the local writer: kept in the window, and the
        same bytes go to the backup."""
        if number > self.last_framed:
            self.last_framed = number
        if self.window.max_bytes:
            self.window.add(number, data)
        if not self.tracker.should_send(number) or self.link is None:
            return
        self.tracker.sent_batch(number, time.monotonic(), len(data))
        self.link.send(wire.batch_frame(number, data))

    def gate(self, local_committed: int) -> int:
        return self.tracker.gate(local_committed)

    # ------------------------------------------------------------------ the listener

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.cfg.replication_host, self.cfg.replication_port,
                                                 reuse_address=True, ssl=self.ssl_context)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("ha: replication listening on %s:%d%s", self.cfg.replication_host, self.port,
                 " (TLS)" if self.ssl_context else "")
        self._timer = self.loop.call_later(CHECK_INTERVAL, self._check)

    @property
    def address(self) -> str:
        return self.cfg.advertised_replication or f"{self.cfg.replication_host}:{self.port}"

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.server is not None:
            self.server.close()
        self._drop()

    def _drop(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%d" % writer.get_extra_info("peername")[:2]
        try:
            await asyncio.wait_for(wire.prove_live(reader, writer, self.cfg.secret), 10.0)
            kind, payload = await asyncio.wait_for(wire.read_frame(reader), 10.0)
            if kind != wire.HELLO:
                raise ValueError(f"a hello expected, not {kind!r}")
            hello = wire.json_payload(payload)
        except (wire.HandshakeFailed, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                ValueError) as exc:
            log.warning("ha: replication connection from %s refused: %s", peer, exc)
            writer.close()
            return
        link = _Link(writer, peer)
        beat = self.loop.create_task(self._heartbeat(link))
        try:
            if not await self._attach(link, hello):
                return
            await self._read_acks(reader, link)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            log.warning("ha: backup %s: replication stream ended: %s", peer, exc)
        finally:
            beat.cancel()
            if self.link is link:
                self.link = None
                self.tracker.detach(time.monotonic())
                log.warning("ha: backup %s detached (%s)", peer, self.tracker.state.value)
                self.store.replica_committed()
            writer.close()

    async def _attach(self, link: _Link, hello: dict) -> bool:
        """REPLICA_TABLE's ATTACH (raising first when the row says so), then the catch-up."""
        while True:
            store = self.store
            inflight = list(store._inflight)   # handed over, not yet reported committed
            first_unsettled = inflight[0][0] if inflight else store.batch
            plan = catch_up_plan(self.lineage, self.window.first, self.window.last, first_unsettled,
                                 hello.get("lineage"), int(hello.get("position", -1)))
            row = self.tracker.attach(plan.first, store.batch - 1, time.monotonic())
            if PeerAction.DROP in row.actions:
                self._drop()
            if PeerAction.RAISE not in row.actions:
                break
            log.warning("ha: backup %s comes back while commits waited for it: raising the activation "
                        "sequence before anything goes on without it", link.peer)
            if not await self._go_alone():
                link.writer.close()
                return False
        # The plan first, then the link counts: no batch can go out ahead of it.
        link.writer.write(wire.json_frame(wire.START, {"lineage": self.lineage, "full": plan.full,
                                                       "first": plan.first, "reason": plan.reason}))
        if plan.full:
            link.queued = []   # batches wait until the copy is out
        self.link = link
        self.last_plan = plan
        log.info("ha: backup %s attached (node %s): %s", link.peer, hello.get("node"), plan.reason)
        self.store.replica_committed()   # a backup not in sync holds nothing back
        if plan.full:
            await self._copy(link, inflight, plan.first - 1)
        else:
            for number, data in self.window.after(plan.first - 1):
                self.framed(number, data)
        return True

    async def _copy(self, link: _Link, inflight: list, through: int) -> None:
        """The store copy, then the batches queued meanwhile."""
        for number, batch in inflight:
            self.framed(number, writer_proc.frame(("batch", number, writer_proc.batch_fields(batch))))
        writer = link.writer
        copy_dir = Path(self.store.path).parent / "ha-copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy_dir.mkdir()
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", COPY_SCRIPT, str(self.store.path),
                                                        str(copy_dir))
            if await proc.wait() != 0:
                raise OSError(f"copying the store for the backup failed (exit {proc.returncode})")
            with open(copy_dir / "data.mdb", "rb") as f:
                while piece := f.read(wire.COPY_PIECE):
                    writer.write(wire.frame(wire.SNAPSHOT, piece))
                    await writer.drain()
        finally:
            shutil.rmtree(copy_dir, ignore_errors=True)
        writer.write(wire.json_frame(wire.SNAPSHOT_END, {"through": through}))
        queued, link.queued = link.queued or [], None
        writer.writelines(queued)
        await writer.drain()
        log.info("ha: store copy sent to the backup; %d batch(es) after it", len(queued))

    async def _heartbeat(self, link: _Link) -> None:
        """Frames on an idle link, so that the backup can tell a dead one; they carry
        the last batch framed here (the backup's lag)."""
        while not link.writer.is_closing():
            link.writer.write(wire.json_frame(wire.HEARTBEAT, {"last": self.last_framed}))
            await asyncio.sleep(wire.HEARTBEAT_EVERY)

    async def _read_acks(self, reader: asyncio.StreamReader, link: _Link) -> None:
        while self.link is link:
            kind, payload = await wire.read_frame(reader)
            if kind != wire.ACK:
                raise ValueError(f"unexpected frame {kind!r} from the backup")
            if self.link is not link:
                return
            if self.tracker.on_ack(wire.ack_number(payload), time.monotonic()):
                link.writer.write(wire.frame(wire.SYNCED))
                self.synced_total += 1
                log.info("ha: backup %s in sync: commits wait for it, it may take over", link.peer)
            self.store.replica_committed()

    # ------------------------------------------------------------------ going on alone

    def _check(self) -> None:
        self._timer = self.loop.call_later(CHECK_INTERVAL, self._check)
        if self.tracker.held:
            return   # this broker accepts nothing now: going on alone waits until it may again
        if self._raising is None and self.tracker.timed_out(time.monotonic()):
            row = self.tracker.on_timeout()
            if PeerAction.DROP in row.actions:
                log.warning("ha: the backup did not keep up while catching up: dropped, it attaches again")
                self._drop()
                self.store.replica_committed()
            if PeerAction.RAISE in row.actions:
                self.loop.create_task(self._go_alone())

    async def _go_alone(self) -> bool:
        """Raise the activation sequence (ZooKeeper, then the store) and stop waiting
        for the backup.  One raise at a time: a second caller waits for the first."""
        if self._raising is not None:
            return await asyncio.shield(self._raising)
        self._raising = self.loop.create_future()
        ok = False
        try:
            count, size, age = self.tracker.lag(time.monotonic())
            log.warning("ha: the backup is %s (%d batch(es), %d bytes unacknowledged, oldest %.1f s): raising "
                        "the activation sequence to go on alone", self.tracker.state.value, count, size, age)
            try:
                seq = await self.raise_activation()
            except Exception as exc:   # ZooKeeper unreachable: we cannot prove we are still live
                self.on_raise_failed(f"raising the activation sequence failed: {exc}", False)
                return False
            if seq is None:
                self.on_raise_failed("the activation sequence was changed by another broker", True)
                return False
            self.store.put_record("meta", ACTIVATION_KEY, str(seq).encode())
            row = self.tracker.raised()
            if PeerAction.DROP in row.actions:
                self._drop()
            self.store.replica_committed()
            log.warning("ha: going on alone at activation %d: the backup must catch up again", seq)
            ok = True
            return True
        finally:
            done, self._raising = self._raising, None
            done.set_result(ok)

    # ------------------------------------------------------------------ figures

    def describe(self) -> dict:
        count, size, age = self.tracker.lag(time.monotonic())
        plan = self.last_plan
        return {"peer": self.link.peer if self.link else None, "peer_state": self.tracker.state.value,
                "in_sync": self.tracker.state is PeerState.IN_SYNC, "synchronous": self.tracker.synchronous,
                "replication_address": self.address, "tls": self.ssl_context is not None,
                "lineage": self.lineage, "last_batch": self.last_framed,
                "lag_batches": count, "lag_bytes": size, "lag_seconds": round(age, 3),
                "acked_batch": self.tracker.acked, "alone_total": self.tracker.alone_total,
                "attached_total": self.tracker.attached_total, "synced_total": self.synced_total,
                "window": {"first": self.window.first, "last": self.window.last, "bytes": self.window.bytes},
                "last_catch_up": None if plan is None else {"full": plan.full, "first": plan.first,
                                                           "reason": plan.reason},
                "held": self.tracker.held}
