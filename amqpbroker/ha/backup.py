"""The backup's side of replication: attach to the live broker, get what the store
lacks (a store copy, or only the batches after its position), then apply the
stream of sealed batches in a writer process of its own (store/writer.py, the very
process a broker uses) and acknowledge each commit.

Not in sync until the live broker says so: before it says hello on a new
connection the backup marks its store incomplete (`NodeState.complete`, synced to
disk), and only the live broker's "in sync" makes it complete again — so a backup
that attached and was not caught up when the live broker died can never take over
(core/ha.py may_activate, REPLICA_TABLE).  Acknowledgements go out on a connection
only once the live broker said how it is caught up (its lineage: batch numbers of
another live run must never be acknowledged), and the position written to
`ha.json` only ever trails what the writer committed.

The store directory is held (store/lock.py) by the node from start to promotion.
The AMQP listener is not open at all while this runs: the broker model is built
only at promotion, from this store, by the usual recovery.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import deque
from pathlib import Path

from ..config import Settings
from ..store import writer as writer_proc
from . import wire
from .state import NodeState

log = logging.getLogger("amqpbroker.ha")

POSITION_EVERY = 1.0     # seconds between writes of the store's position to ha.json


class BackupApplier:
    def __init__(self, settings: Settings, state: NodeState, lock_fd: int | None):
        self.settings = settings
        self.state = state
        self.store_dir = Path(settings.data_dir) / "store"
        self.incoming = Path(settings.data_dir) / "ha-incoming.mdb"
        self.lock_fd = lock_fd
        self.writer: asyncio.subprocess.Process | None = None
        self.address: str | None = None
        self.connected = False
        self.in_sync = False
        self.lineage = state.lineage if (self.store_dir / "data.mdb").exists() else None
        self.acked = state.position if self.lineage else -1
        self.live_last = -1                     # the live broker's last batch (heartbeats)
        self.unapplied: deque[tuple[int, int]] = deque()   # (number, bytes) handed to the writer, not committed
        self.ack_to: asyncio.StreamWriter | None = None
        self.catch_ups = {"full": 0, "batches": 0}
        self.last_catch_up: dict | None = None
        self._catch_up_started = 0.0
        self._position_at = 0.0
        self._results_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ the stream

    async def replicate(self, address: str, ssl_context=None) -> None:
        """Attach to the live broker at `address` and follow it until the stream ends."""
        host, _, port = address.rpartition(":")
        self.address = address
        reader, out = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=ssl_context), 5.0)
        try:
            await asyncio.wait_for(wire.prove_backup(reader, out, self.settings.ha.secret), 10.0)
            # Not in sync from here on, until the live broker says so: marked (and on
            # disk) before the hello that makes this connection count.
            self.state.set_complete(False)
            self.in_sync = False
            out.write(wire.json_frame(wire.HELLO, {"node": self.state.node_id, "lineage": self.lineage,
                                                   "position": self.acked}))
            self.connected = True
            log.info("ha: attaching to the live broker at %s (store at %s)", address, self._position_text())
            copy = None
            through = -1
            while True:
                kind, payload = await asyncio.wait_for(wire.read_frame(reader), wire.SILENT_LINK)
                if kind == wire.BATCH:
                    number, data = wire.batch_payload(payload)
                    self.writer.stdin.write(data)
                    self.unapplied.append((number, len(data)))
                    await self.writer.stdin.drain()
                elif kind == wire.HEARTBEAT:
                    self.live_last = int(wire.json_payload(payload).get("last", -1))
                elif kind == wire.START:
                    await self._start(wire.json_payload(payload), out)
                elif kind == wire.SNAPSHOT:
                    if copy is None:
                        copy = open(self.incoming, "wb")
                    copy.write(payload)
                elif kind == wire.SNAPSHOT_END:
                    through = int(wire.json_payload(payload)["through"])
                    await self._install(copy, out, through)
                    copy = None
                elif kind == wire.SYNCED:
                    self.state.set_complete(True)
                    self.in_sync = True
                    self._caught_up()
                    log.info("ha: in sync with the live broker: this backup may take over")
                else:
                    raise ValueError(f"unexpected replication frame {kind!r}")
        finally:
            self.connected = False
            self.in_sync = False
            self.ack_to = None
            out.close()

    async def _start(self, start: dict, out: asyncio.StreamWriter) -> None:
        """The live broker says how this store is caught up."""
        self._catch_up_started = time.monotonic()
        self.last_catch_up = {"full": bool(start["full"]), "first": start["first"], "reason": start["reason"],
                              "seconds": None}
        if start["full"]:
            self.catch_ups["full"] += 1
            log.info("ha: the live broker sends a copy of its store: %s", start["reason"])
            await self.stop_writer()
            self.lineage, self.acked = start["lineage"], -1
            self.state.set_position(None, -1)    # the store is about to be replaced
            return
        self.catch_ups["batches"] += 1
        log.info("ha: the live broker sends only what this store lacks: %s", start["reason"])
        if self.writer is None:
            await self._start_writer()
        self.ack_to = out
        out.write(wire.ack_frame(self.acked))   # what this store holds, in the live broker's lineage

    async def _install(self, copy, out: asyncio.StreamWriter, through: int) -> None:
        if copy is None:
            copy = open(self.incoming, "wb")   # an empty store sends no piece
        copy.flush()
        os.fsync(copy.fileno())
        copy.close()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        for name in ("lock.mdb",):   # no reader is left: the writer has exited
            (self.store_dir / name).unlink(missing_ok=True)
        os.replace(self.incoming, self.store_dir / "data.mdb")
        await self._start_writer()
        self.acked = through
        self.state.set_position(self.lineage, through)
        self.ack_to = out
        out.write(wire.ack_frame(through))   # the copy is in: everything through it is here
        log.info("ha: store copy installed (%d bytes)", (self.store_dir / "data.mdb").stat().st_size)

    def _caught_up(self) -> None:
        if self.last_catch_up is not None and self.last_catch_up["seconds"] is None:
            self.last_catch_up["seconds"] = round(time.monotonic() - self._catch_up_started, 3)
            log.info("ha: caught up in %.2f s (%s)", self.last_catch_up["seconds"],
                     "store copy" if self.last_catch_up["full"] else "batches only")

    def _position_text(self) -> str:
        return f"batch {self.acked} of {self.lineage}" if self.lineage else "no position: a copy is needed"

    # ------------------------------------------------------------------ the writer process

    async def _start_writer(self) -> None:
        st = self.settings.store
        size = (self.store_dir / "data.mdb").stat().st_size
        map_size = max(st.initial_map_size, -(-size * 2 // (1 << 20)) << 20)
        root = str(Path(writer_proc.__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.writer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "amqpbroker.store.writer", str(self.store_dir), str(map_size),
            str(max(st.max_map_size, map_size)), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, pass_fds=() if self.lock_fd is None else (self.lock_fd,))
        self.unapplied.clear()
        self._results_task = asyncio.get_running_loop().create_task(self._relay_results(self.writer))

    async def _relay_results(self, proc: asyncio.subprocess.Process) -> None:
        """Each commit result of the writer is an acknowledgement to the live broker
        (on the connection that may hear it), and in time the store's position."""
        buf = bytearray()
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return
            buf += chunk
            for number, kind, text, *_ in writer_proc.take_frames(buf):
                if kind is not None:   # this copy is no good any more: a new one is needed
                    log.error("ha: applying replicated batches failed: %s", text)
                    self.state.set_complete(False)
                    self.state.set_position(None, -1)
                    self.lineage = None
                    if self.ack_to is not None:
                        self.ack_to.close()
                    return
                self.acked = max(self.acked, number)
                while self.unapplied and self.unapplied[0][0] <= number:
                    self.unapplied.popleft()
                if self.ack_to is not None and not self.ack_to.is_closing():
                    self.ack_to.write(wire.ack_frame(number))
            now = time.monotonic()
            if now >= self._position_at:
                self._position_at = now + POSITION_EVERY
                self.state.set_position(self.lineage, self.acked)

    async def stop_writer(self) -> None:
        """Commit what it has and exit (before a new copy, and before promotion)."""
        proc, self.writer = self.writer, None
        if proc is None:
            return
        try:
            proc.stdin.write(writer_proc.frame(("stop",)))
            await proc.stdin.drain()
            proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 30.0)
        except (OSError, asyncio.TimeoutError) as exc:
            log.error("ha: the backup's writer did not stop cleanly (%s): killed", exc)
            proc.kill()
            await proc.wait()
        if self._results_task is not None:
            try:
                await asyncio.wait_for(self._results_task, 5.0)
            except (asyncio.TimeoutError, Exception):
                self._results_task.cancel()
            self._results_task = None
        if self.lineage is not None:
            self.state.set_position(self.lineage, self.acked)

    # ------------------------------------------------------------------ figures

    def describe(self) -> dict:
        lag = max(0, self.live_last - self.acked) if self.connected and self.live_last >= 0 else None
        return {"replicating_from": self.address if self.connected else None, "in_sync": self.in_sync,
                "store_complete": self.state.complete, "lineage": self.lineage, "acked_batch": self.acked,
                "live_batch": self.live_last if self.connected else None, "lag_batches": lag,
                "lag_bytes": sum(size for _, size in self.unapplied), "writer": self.writer is not None,
                "catch_ups": dict(self.catch_ups), "last_catch_up": self.last_catch_up}
