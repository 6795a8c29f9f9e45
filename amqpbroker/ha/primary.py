"""The live broker's side of replication: a listener for its backup, the store copy,
the stream of sealed batches, acknowledgements, and going on alone.

Installed as `LmdbStore.replica` (store/channel.py calls `framed` for every batch
frame it writes to its own writer, and `gate` before it runs commit callbacks).
When a backup connects (Artemis' replication does the same in its own terms):

1. `ReplicaTracker.attach`: the batches not yet reported committed locally, and
   every one framed from now on, are to be sent after the copy;
2. the store is copied (`Environment.copy`, compacted) in a child process: its
   read transaction starts after step 1, so it holds at least everything
   committed before, and the batches sent after it replay a prefix that may be
   in it already: blind puts and deletes end in the same state (store/batch.py);
3. the copy and then the batches go out; the backup applies them in its own
   writer and acknowledges per batch number; from the moment it caught up,
   commits wait for it (`gate`: synchronous replication).

A backup that stops acknowledging for `backup_timeout`, or goes away while
waited for, is given up: the activation sequence is raised in ZooKeeper first
(so it can never take over with what it has; core/ha.py), then in the store, and
commits go on alone.  If the raise fails (ZooKeeper unreachable, or another
broker raised it: it is live now), this broker is fenced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..config import HaConfig
from ..core.ha import ReplicaTracker
from ..store import writer as writer_proc
from . import wire
from .state import ACTIVATION_KEY

log = logging.getLogger("amqpbroker.ha")

CHECK_INTERVAL = 0.1   # seconds between looks at the backup's lag
COPY_SCRIPT = ("import lmdb, sys\n"
               "env = lmdb.open(sys.argv[1], readonly=True, max_dbs=16, lock=True, readahead=False)\n"
               "env.copy(sys.argv[2], compact=True)\n")


class ReplicationServer:
    def __init__(self, cfg: HaConfig, store: Any, loop: asyncio.AbstractEventLoop,
                 raise_activation: Callable[[], Awaitable[int | None]], fence: Callable[[str], None]):
        self.cfg = cfg
        self.store = store
        self.loop = loop
        self.tracker = ReplicaTracker(cfg.synchronous, cfg.backup_timeout)
        self.raise_activation = raise_activation   # → the new sequence, or None (fenced)
        self.fence = fence
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.peer: str | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._queued: list[bytes] | None = None    # batch frames held back while the copy goes out
        self._timer: asyncio.TimerHandle | None = None
        self._going_alone = False
        self.synced_total = 0

    # ------------------------------------------------------------------ store hooks

    def framed(self, number: int, data: bytes) -> None:
        """A batch frame on its way to the local writer: the same bytes go to the backup."""
        if not self.tracker.should_send(number):
            return
        self.tracker.sent_batch(number, time.monotonic())
        out = wire.frame(wire.BATCH, data)
        if self._queued is not None:
            self._queued.append(out)
        elif self._writer is not None:
            self._writer.write(out)

    def gate(self, local_committed: int) -> int:
        return self.tracker.gate(local_committed)

    # ------------------------------------------------------------------ the listener

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.cfg.replication_host,
                                                 self.cfg.replication_port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("ha: replication listening on %s:%d", self.cfg.replication_host, self.port)
        self._timer = self.loop.call_later(CHECK_INTERVAL, self._check)

    @property
    def address(self) -> str:
        return self.cfg.advertised_replication or f"{self.cfg.replication_host}:{self.port}"

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.server is not None:
            self.server.close()
        if self._writer is not None:
            self._writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%d" % writer.get_extra_info("peername")[:2]
        try:
            await asyncio.wait_for(wire.prove_live(reader, writer, self.cfg.secret), 10.0)
        except (wire.HandshakeFailed, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            log.warning("ha: replication connection from %s refused: %s", peer, exc)
            writer.close()
            return
        if self._writer is not None:
            log.warning("ha: a second backup (%s) refused: %s is attached", peer, self.peer)
            writer.close()
            return
        self._writer, self.peer = writer, peer
        log.info("ha: backup %s attached: sending a copy of the store", peer)
        try:
            await self._sync(writer)
            await self._read_acks(reader, writer)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            log.warning("ha: backup %s: replication stream ended: %s", peer, exc)
        finally:
            if self._writer is writer:
                self._writer = None
                self._queued = None
                self.tracker.detach(time.monotonic())
                log.warning("ha: backup %s detached (%s)", peer, self.tracker.state.value)
            writer.close()

    # ------------------------------------------------------------------ copy, then stream

    async def _sync(self, writer: asyncio.StreamWriter) -> None:
        store = self.store
        inflight = list(store._inflight)   # handed over, not yet reported committed
        first = inflight[0][0] if inflight else store.batch
        self.tracker.attach(first, store.batch - 1)
        self._queued = []
        for number, batch in inflight:
            self.framed(number, writer_proc.frame(("batch", number, writer_proc.batch_fields(batch))))
        copy_dir = Path(store.path).parent / "ha-copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy_dir.mkdir()
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", COPY_SCRIPT, str(store.path),
                                                        str(copy_dir))
            if await proc.wait() != 0:
                raise OSError(f"copying the store for the backup failed (exit {proc.returncode})")
            with open(copy_dir / "data.mdb", "rb") as f:
                while piece := f.read(wire.COPY_PIECE):
                    writer.write(wire.frame(wire.SNAPSHOT, piece))
                    await writer.drain()
        finally:
            shutil.rmtree(copy_dir, ignore_errors=True)
        writer.write(wire.frame(wire.SNAPSHOT_END, json.dumps({"through": first - 1}).encode()))
        queued, self._queued = self._queued or [], None
        writer.writelines(queued)
        await writer.drain()
        log.info("ha: store copy sent to the backup; %d batch(es) after it", len(queued))

    async def _read_acks(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            kind, payload = await wire.read_frame(reader)
            if kind != wire.ACK:
                raise ValueError(f"unexpected frame {kind!r} from the backup")
            if self.tracker.on_ack(wire.ack_number(payload), time.monotonic()):
                writer.write(wire.frame(wire.SYNCED))
                self.synced_total += 1
                log.info("ha: backup %s in sync: commits wait for it, it may take over", self.peer)
            self.store.replica_committed()

    # ------------------------------------------------------------------ going on alone

    def _check(self) -> None:
        self._timer = self.loop.call_later(CHECK_INTERVAL, self._check)
        if not self._going_alone and self.tracker.due_alone(time.monotonic()):
            self._going_alone = True
            self.loop.create_task(self._go_alone())

    async def _go_alone(self) -> None:
        lag = self.tracker.lag(time.monotonic())
        log.warning("ha: the backup is %s (%d batch(es) unacknowledged, oldest %.1f s): raising the "
                    "activation sequence to go on alone", self.tracker.state.value, lag[0], lag[1])
        try:
            seq = await self.raise_activation()
        except Exception as exc:   # ZooKeeper unreachable: we cannot prove we are still live
            log.error("ha: raising the activation sequence failed: %s", exc)
            seq = None
        if seq is None:
            self._going_alone = False
            self.fence("the activation sequence could not be raised: another broker may be live")
            return
        self.store.put_record("meta", ACTIVATION_KEY, str(seq).encode())
        self.tracker.went_alone()
        if self._writer is not None:
            self._writer.close()
        self.store.replica_committed()
        self._going_alone = False
        log.warning("ha: going on alone at activation %d: the backup must copy the store again", seq)

    # ------------------------------------------------------------------ figures

    def describe(self) -> dict:
        count, age = self.tracker.lag(time.monotonic())
        return {"peer": self.peer, "peer_state": self.tracker.state.value,
                "synchronous": self.tracker.synchronous, "replication_address": self.address,
                "lag_batches": count, "lag_seconds": round(age, 3),
                "acked_batch": self.tracker.acked, "alone_total": self.tracker.alone_total,
                "synced_total": self.synced_total, "held": self.tracker.held}
