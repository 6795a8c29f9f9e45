"""The backup's side of replication: receive the live broker's store copy, install
it, then apply the stream of sealed batches in a writer process of its own
(store/writer.py, the very process a broker uses) and acknowledge each commit.

The store directory is held (store/lock.py) from the first piece of a copy to
promotion.  `NodeState.complete` is false from the first piece of a copy until
the live broker says "synced": a backup killed half way through a copy must
never take over with it (core/ha.py may_activate).  The AMQP listener is not
open at all while this runs: the broker model is built only at promotion,
from this store, by the usual recovery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from ..config import Settings
from ..store import writer as writer_proc
from . import wire
from .state import NodeState

log = logging.getLogger("amqpbroker.ha")


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
        self.acked = -1
        self._results_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ the stream

    async def replicate(self, address: str) -> None:
        """Copy and follow the live broker at `address` until the stream ends."""
        host, _, port = address.rpartition(":")
        self.address = address
        reader, out = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
        try:
            await asyncio.wait_for(wire.prove_backup(reader, out, self.settings.ha.secret), 10.0)
            self.connected = True
            log.info("ha: replicating from the live broker at %s", address)
            copy = None
            while True:
                kind, payload = await wire.read_frame(reader)
                if kind == wire.BATCH:
                    self.writer.stdin.write(payload)
                    await self.writer.stdin.drain()
                elif kind == wire.SNAPSHOT:
                    if copy is None:
                        copy = await self._begin_copy()
                    copy.write(payload)
                elif kind == wire.SNAPSHOT_END:
                    through = json.loads(payload)["through"]
                    await self._install(copy, out, through)
                    copy = None
                elif kind == wire.SYNCED:
                    self.state.set_complete(True)
                    log.info("ha: in sync with the live broker: this backup may take over")
                else:
                    raise ValueError(f"unexpected replication frame {kind!r}")
        finally:
            self.connected = False
            out.close()

    async def _begin_copy(self):
        """A new copy: what this store holds is no longer a complete copy of anything."""
        self.state.set_complete(False)
        await self.stop_writer()
        return open(self.incoming, "wb")

    async def _install(self, copy, out: asyncio.StreamWriter, through: int) -> None:
        copy.flush()
        os.fsync(copy.fileno())
        copy.close()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        for name in ("lock.mdb",):   # no reader is left: the writer has exited
            (self.store_dir / name).unlink(missing_ok=True)
        os.replace(self.incoming, self.store_dir / "data.mdb")
        await self._start_writer(out)
        self.acked = through
        out.write(wire.ack_frame(through))   # the copy is in: everything through it is here
        log.info("ha: store copy installed (%d bytes)", (self.store_dir / "data.mdb").stat().st_size)

    # ------------------------------------------------------------------ the writer process

    async def _start_writer(self, out: asyncio.StreamWriter) -> None:
        st = self.settings.store
        size = (self.store_dir / "data.mdb").stat().st_size
        map_size = max(st.initial_map_size, -(-size * 2 // (1 << 20)) << 20)
        root = str(Path(writer_proc.__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.writer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "amqpbroker.store.writer", str(self.store_dir), str(map_size),
            str(max(st.max_map_size, map_size)), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, pass_fds=() if self.lock_fd is None else (self.lock_fd,))
        self._results_task = asyncio.get_running_loop().create_task(self._relay_results(self.writer, out))

    async def _relay_results(self, proc: asyncio.subprocess.Process, out: asyncio.StreamWriter) -> None:
        """Each commit result of the writer is an acknowledgement to the live broker."""
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
                    out.close()
                    return
                self.acked = number
                out.write(wire.ack_frame(number))

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

    def describe(self) -> dict:
        return {"replicating_from": self.address if self.connected else None, "acked_batch": self.acked,
                "writer": self.writer is not None}
