"""One broker of an HA pair, from start to stop (cli.py runs this instead of a plain
BrokerServer when the configuration has an `[ha]` section).

  backup ──(live lock taken, store eligible, activation raised)──▶ live ──(fenced)──▶ exit 3
     ▲                                                              │
     └────────────────── (restart by the supervisor) ◀──────────────┘

As a backup, no AMQP listener is open (clients fail over past it) and no broker
model exists: the store is a copy the live broker keeps up to date
(ha/backup.py).  Every POLL seconds it looks at ZooKeeper: who is live (to
replicate from), and whether it may contend for the lock (core/ha.py
`may_activate`, `contends`).  Once it holds the lock it stops its writer,
raises the activation sequence (compare-and-set) and starts a BrokerServer on
its store: recovery brings delivered-but-unsettled messages back redelivered,
rolls back transactions in doubt, and rebuilds subscriptions, as after a
restart.  As live it serves its backup (ha/primary.py) and watches its
ZooKeeper session (core/ha.py `session_verdict`): in doubt, nothing is
acknowledged; lost, it stops accepting at once and exits with status 3 (run
it under a supervisor that restarts it: it comes back as the backup).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from ..config import Settings
from ..core.ha import Activation, Role, SessionVerdict, contends, may_activate, session_verdict
from ..store.lock import StoreLock
from .backup import BackupApplier
from .primary import ReplicationServer
from .state import ACTIVATION_KEY, NodeState, stored_activation
from .zk import ZkSession

log = logging.getLogger("amqpbroker.ha")

POLL = 0.2          # seconds between looks at ZooKeeper while backup
RETRY = 0.5         # seconds before connecting to the live broker again
FENCED_EXIT = 3


class HaNode:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop, stopped: asyncio.Event):
        if not settings.store.enabled:
            raise ValueError("[ha] replicates the store: it needs [store] enabled = true")
        self.settings = settings
        self.cfg = settings.ha
        self.loop = loop
        self.stopped = stopped
        self.role = Role(self.cfg.role)
        self.state = NodeState.load(settings.data_dir, self.cfg.node_id)
        self.store_dir = Path(settings.data_dir) / "store"
        self.zk = ZkSession(self.cfg, loop, self._session_changed)
        self.status = "starting"           # starting | backup | live | fenced | stopped
        self.activation = Activation()
        self.version = -1
        self.server: Any = None
        self.replication: ReplicationServer | None = None
        self.applier: BackupApplier | None = None
        self.suspended_at: float | None = None
        self.exit_code = 0
        self.last_reason = ""
        self.server_options: dict = {}      # BrokerServer's config_file / overrides (live reload)

    # ------------------------------------------------------------------ start to stop

    async def run(self) -> int:
        await self.zk.start()
        log.info("ha: node %s (%s) connected to ZooKeeper at %s", self.state.node_id, self.role.value,
                 self.cfg.zookeeper)
        try:
            if await self._backup_until_live():
                await self._live()
        finally:
            await self.zk.stop()
        return self.exit_code

    async def _backup_until_live(self) -> bool:
        """Replicate from whoever is live until this node holds the lock and may activate."""
        self.status = "backup"
        lock = StoreLock(self.store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        self.applier = BackupApplier(self.settings, self.state, lock.fd)
        log.info("ha: backup: the AMQP listener stays closed until this node is live")
        task: asyncio.Task | None = None
        try:
            while not self.stopped.is_set():
                info, mine = await self.zk.live()
                if info is None:
                    if await self._try_activate():
                        return True
                elif not mine and info.get("replication") and (task is None or task.done()):
                    task = self.loop.create_task(self._follow(info["replication"]))
                try:
                    await asyncio.wait_for(self.stopped.wait(), POLL)
                except asyncio.TimeoutError:
                    pass
            return False
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await self.applier.stop_writer()
            lock.release()

    async def _follow(self, address: str) -> None:
        try:
            await self.applier.replicate(address)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
            log.info("ha: replication from %s ended: %s", address, exc)
        except Exception as exc:   # a bug, or the copy failed: logged, tried again
            log.error("ha: replication from %s failed", address, exc_info=exc)
        await asyncio.sleep(RETRY)

    def _eligible(self):
        stored = stored_activation(self.store_dir)
        return may_activate(stored, self.state.complete, self.activation, self.state.node_id), stored

    async def _try_activate(self) -> bool:
        """Nobody is live: contend if allowed; holding the lock, check again on a quiet
        store and raise the activation sequence (a compare-and-set: a broker that raced
        us to it makes this fail)."""
        self.activation, self.version = await self.zk.activation()
        verdict, _ = self._eligible()
        if not contends(self.role, verdict, self.activation):
            if verdict.reason != self.last_reason:
                self.last_reason = verdict.reason
                log.info("ha: not contending for live: %s", verdict.reason)
            return False
        if not await self.zk.try_lock({"node": self.state.node_id}):
            return False
        await self.applier.stop_writer()    # the copy is final now: no more batches come
        self.activation, self.version = await self.zk.activation()
        verdict, stored = self._eligible()
        new = self.activation.next_by(self.state.node_id)
        if not verdict.ok or not await self.zk.raise_activation(self.version, new):
            log.warning("ha: took the live lock but may not activate (%s): released", verdict.reason)
            await self.zk.release_lock()
            return False
        self.activation, self.version = await self.zk.activation()
        log.warning("ha: node %s is live: activation %d (store at %d)", self.state.node_id, new.seq, stored)
        return True

    # ------------------------------------------------------------------ live

    async def _live(self) -> None:
        from ..server.app import BrokerServer

        self.status = "live"
        server = self.server = BrokerServer(self.settings, self.loop, **self.server_options)
        server.ha = self
        self.replication = ReplicationServer(self.cfg, server.store, self.loop, self._raise_again, self.fence)
        server.store.replica = self.replication
        timer = None
        try:
            await server.start()
            server.store.put_record("meta", ACTIVATION_KEY, str(self.activation.seq).encode())
            await self.replication.start()
            amqp = server.listeners[0]
            await self.zk.publish({"node": self.state.node_id, "replication": self.replication.address,
                                   "amqp": f"{amqp.host}:{amqp.port}"})
            timer = self.loop.call_later(POLL, self._watch_session)
            await self.stopped.wait()
        finally:
            if timer is not None:
                timer.cancel()
            await self.replication.close()
            if self.status == "live":
                self.status = "stopped"
            await server.stop(grace=0.5 if self.status == "fenced" else 5.0)

    async def _raise_again(self) -> int | None:
        """Going on without the backup (ha/primary.py): the next activation, or None
        when another broker changed it (it is live: this one is fenced)."""
        new = self.activation.next_by(self.state.node_id)
        if self.zk.state != "CONNECTED" or not await self.zk.raise_activation(self.version, new):
            return None
        self.activation, self.version = await self.zk.activation()
        return new.seq

    def _session_changed(self, state: str) -> None:
        if state == "SUSPENDED" and self.suspended_at is None:
            self.suspended_at = time.monotonic()
        elif state == "CONNECTED":
            self.suspended_at = None
        if self.status == "live":
            self._watch_session(rearm=False)

    def _watch_session(self, rearm: bool = True) -> None:
        if rearm:
            self.loop.call_later(POLL, self._watch_session)
        if self.status != "live":
            return
        verdict = session_verdict(self.zk.state, self.suspended_at, time.monotonic(),
                                  self.cfg.zookeeper_session_timeout)
        tracker = self.replication.tracker
        if verdict is SessionVerdict.FENCED:
            self.fence(f"the ZooKeeper session is {self.zk.state.lower()}: another broker may be live")
        elif (verdict is SessionVerdict.HOLD) != tracker.held:
            tracker.held = verdict is SessionVerdict.HOLD
            log.warning("ha: ZooKeeper %s: %s", self.zk.state,
                        "nothing is acknowledged until it is back" if tracker.held else "acknowledging again")
            if not tracker.held:
                self.server.store.replica_committed()

    def fence(self, reason: str) -> None:
        """Stop accepting at once: no producer is told Accepted from here on, every
        listener and connection closes, and the process exits (FENCED_EXIT)."""
        if self.status != "live":
            return
        self.status = "fenced"
        self.exit_code = FENCED_EXIT
        log.error("ha: fenced: %s; closing every connection and exiting", reason)
        self.replication.tracker.held = True
        for lst in self.server.listeners:
            if lst.server is not None:
                lst.server.close()
        for proto in list(self.server.protocols):
            proto.abort()
        self.stopped.set()

    # ------------------------------------------------------------------ figures (management)

    def describe(self) -> dict:
        out = {"enabled": True, "node_id": self.state.node_id, "role": self.role.value, "status": self.status,
               "activation": self.activation.seq, "zookeeper": {"hosts": self.cfg.zookeeper,
                                                                "session": self.zk.state,
                                                                "session_timeout": self.cfg.zookeeper_session_timeout}}
        if self.replication is not None:
            out["replication"] = self.replication.describe()
        return out


async def run_node(settings: Settings, loop: asyncio.AbstractEventLoop, config_file: Any = None,
                   overrides: dict | None = None) -> int:
    """cli.py's entry with [ha]: until SIGTERM / SIGINT, or fenced."""
    from ..server.app import install_signal_handlers
    from ..store.base import StoreError

    stopped = asyncio.Event()
    install_signal_handlers(loop, stopped.set)
    try:
        node = HaNode(settings, loop, stopped)
        node.server_options = {"config_file": config_file, "overrides": overrides}   # live reload
        return await node.run()
    except (ValueError, OSError, StoreError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except Exception as exc:   # kazoo's timeouts (ZooKeeper unreachable) and the like
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        return 2
