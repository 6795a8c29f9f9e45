"""One broker of an HA pair, from start to stop (cli.py runs this instead of a plain
BrokerServer when the configuration has an `[ha]` section).

  backup ──(live lock taken, store eligible, activation raised)──▶ live
     ▲                                                               │
     └───────────── (lock or session lost: demoted, same process) ◀──┘

Nothing about ZooKeeper ends the process: its session's states (core/ha.py
SESSION_TABLE) are logged once each and shown in /api/ha; kazoo reconnects and
makes a new session after an expiry.

As a backup, no AMQP listener is open (clients fail over past it) and no broker
model exists: the store is a copy the live broker keeps up to date
(ha/backup.py); a read-only management API answers (management/ha.py
BackupApi).  Every POLL seconds it looks at ZooKeeper: who is live (to replicate
from), and whether it may contend for the lock (core/ha.py `may_activate`,
`contends`).  Once it holds the lock it stops following, stops its writer,
checks again on the quiet store, raises the activation sequence
(compare-and-set) and starts a BrokerServer on its store: recovery brings
delivered-but-unsettled messages back redelivered, rolls back transactions in
doubt, and rebuilds subscriptions, as after a restart.

As live it serves its backup (ha/primary.py) and keeps its right to accept
(core/ha.py LIVE_TABLE, `LiveFence`): a lease renewed by a ZooKeeper round trip
every sixth of the session timeout; a check of the clock and the lease before
any input is read and any output written (`guard`, called by the server); the
moment the session is in doubt it stops accepting — listener closed, every
connection closed (amqp:connection:forced) or dropped, nothing released — and it
opens again only once ZooKeeper confirmed, over the same session, the lock and
the activation.  A lock that is gone (the session expired, another broker raised
the activation) demotes it: the BrokerServer stops and the node is a backup again.

A node of a cluster that is a pair runs its cluster side (membership, forwarding)
beside the live broker only: a LiveCompanion (cluster/pair.py), made each time this
broker goes live and closed before its BrokerServer stops.

Each accept window is logged with the activation it serves ("ha: accept window
open: ... at=<time.time()>" / "... closed: ..."): a checker (tests/faults) reads
them to verify that no two brokers ever accepted at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from ..config import Settings
from ..core.ha import (
    SESSION_TABLE,
    Activation,
    Fence,
    LiveEvent,
    LiveFence,
    LiveState,
    Role,
    Session,
    contends,
    may_activate,
)
from ..server.tls import chosen_file
from ..store.base import StoreError
from ..store.lock import StoreLock
from . import wire
from .backup import BackupApplier
from .primary import ReplicationServer
from .state import ACTIVATION_KEY, NodeState, stored_activation
from .zk import ZkSession, ZkUnavailable

log = logging.getLogger("amqpbroker.ha")

POLL = 0.2          # seconds between looks at ZooKeeper while backup
RETRY = 0.5         # seconds before connecting to the live broker again
TICK = 0.1          # seconds between the live broker's looks at its lease and the clock
CLOSE_GRACE = 0.5   # seconds a connection closed by a fence has to read its close before it is dropped


def _wall(mono: float) -> float:
    """time.time() of a time.monotonic() reading."""
    return time.time() - (time.monotonic() - mono)


def replication_tls(settings: Settings) -> tuple[Any, Any]:
    """(server context, client context) of the replication link, or (None, None)."""
    ha = settings.ha
    if not ha.replication_tls:
        return None, None
    tls = settings.tls
    cert_name, cert = chosen_file("replication_cert_file", ha.replication_cert_file, tls, "cert_file")
    key_name, key = chosen_file("replication_key_file", ha.replication_key_file, tls, "key_file")
    if cert is None or key is None:
        raise ValueError("[ha] replication_tls needs replication_cert_file and replication_key_file "
                         "(or a [tls] section)")
    ca_name, ca = ("replication_ca_file", ha.replication_ca_file) if ha.replication_ca_file else (cert_name, cert)
    return (wire.server_context(str(cert), str(key), (cert_name, key_name)),
            wire.client_context(str(ca), ca_name))


class LiveCompanion(Protocol):
    """What runs beside the live broker of the pair, and only there (a `[cluster]`
    node's membership and forwarding, cluster/pair.py): made anew each time this
    broker goes live, closed before its BrokerServer stops."""

    async def prepare(self, server: Any) -> None:
        """Before the server starts (it may set the server's ports)."""

    async def started(self, server: Any) -> None:
        """Once the server listens and the pair's live znode names it."""

    async def close(self) -> None:
        """This broker stops being live (stopped or demoted)."""


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
        self.server_tls, self.client_tls = replication_tls(settings)
        self.zk = ZkSession(self.cfg, loop, self._session_changed)
        self.status = "starting"           # starting | backup | live | stopped
        self.activation = Activation()
        self.version = -1
        self.server: Any = None
        self.replication: ReplicationServer | None = None
        self.applier: BackupApplier | None = None
        self.fence: LiveFence | None = None
        self.fenced_total = 0
        self.demoted_total = 0
        self.windows = 0                    # accept windows opened
        self._window_open = False
        self._demoted = asyncio.Event()
        self._leaving = False               # the live broker is stopping: no re-validation, no reopening
        self._lease_sent_at = 0.0
        self._last_reason = ""
        self._api: Any = None
        self.server_options: dict = {}      # BrokerServer's config_file / overrides (live reload)
        self.companion_factory: Callable[[], LiveCompanion] | None = None

    # ------------------------------------------------------------------ start to stop

    async def run(self) -> int:
        self.zk.start()
        log.info("ha: node %s (%s) of cluster %s, ZooKeeper at %s", self.state.node_id, self.role.value,
                 self.cfg.cluster, self.cfg.zookeeper)
        try:
            while not self.stopped.is_set():
                await self._start_api()
                live = await self._backup_until_live()
                await self._stop_api()
                if not live or not await self._live():
                    break
                self.demoted_total += 1
                log.warning("ha: node %s is a backup again", self.state.node_id)
        finally:
            await self._stop_api()
            self.status = "stopped"
            await self.zk.stop()
        return 0

    async def _start_api(self) -> None:
        from ..management.ha import BackupApi
        self._api = BackupApi(self.settings, self)
        await self._api.start()

    async def _stop_api(self) -> None:
        if self._api is not None:
            await self._api.stop()
            self._api = None

    # ------------------------------------------------------------------ backup

    async def _backup_until_live(self) -> bool:
        """Replicate from whoever is live until this node holds the lock and may activate."""
        self.status = "backup"
        lock = StoreLock(self.store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        self.applier = BackupApplier(self.settings, self.state, lock.fd)
        log.info("ha: backup: the AMQP listener stays closed until this node is live")
        follow: list[asyncio.Task | None] = [None]
        try:
            while not self.stopped.is_set():
                if SESSION_TABLE[self.zk.state].may_look and await self._look(follow):
                    return True
                try:
                    await asyncio.wait_for(self.stopped.wait(), POLL)
                except asyncio.TimeoutError:
                    pass
            return False
        finally:
            await self._unfollow(follow)
            await self.applier.stop_writer()
            lock.release()

    async def _look(self, follow: list) -> bool:
        """One look at ZooKeeper: follow the live broker, or contend.  True: live now."""
        try:
            info, mine = await self.zk.live()
            if info is None:
                return await self._try_activate(follow)
            self._last_reason = ""
            if mine:   # a lock this session took and could not use (a failed activation): give it back
                await self.zk.release_lock()
            elif info.get("replication") and (follow[0] is None or follow[0].done()):
                follow[0] = self.loop.create_task(self._follow(info["replication"]))
        except ZkUnavailable as exc:
            log.debug("ha: backup: ZooKeeper did not answer: %s", exc)
        except ValueError as exc:   # an activation node that does not decode: refuse to act on it
            if str(exc) != self._last_reason:
                self._last_reason = str(exc)
                log.error("ha: ZooKeeper's data under %s cannot be read (%s): not contending", self.zk.root, exc)
        return False

    async def _follow(self, address: str) -> None:
        try:
            await self.applier.replicate(address, self.client_tls)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError,
                wire.HandshakeFailed) as exc:
            log.info("ha: replication from %s ended: %s", address, exc or type(exc).__name__)
        except Exception as exc:   # a bug, or the copy failed: logged, tried again
            log.error("ha: replication from %s failed", address, exc_info=exc)
        await asyncio.sleep(RETRY)

    async def _unfollow(self, follow: list) -> None:
        task, follow[0] = follow[0], None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _eligible(self):
        stored = stored_activation(self.store_dir)
        return may_activate(stored, self.state.complete, self.activation, self.state.node_id), stored

    async def _try_activate(self, follow: list) -> bool:
        """Nobody is live: contend if allowed; holding the lock, stop following, check
        again on a quiet store and raise the activation sequence (a compare-and-set:
        a broker that raced us to it makes this fail)."""
        self.activation, self.version = await self.zk.activation()
        verdict, _ = self._eligible()
        if not contends(self.role, verdict, self.activation):
            if verdict.reason != self._last_reason:
                self._last_reason = verdict.reason
                log.info("ha: not contending for live (no broker is live): %s", verdict.reason)
            return False
        if not await self.zk.try_lock({"node": self.state.node_id}):
            return False
        await self._unfollow(follow)
        await self.applier.stop_writer()    # the store is final now: no more batches come
        self.activation, self.version = await self.zk.activation()
        verdict, stored = self._eligible()
        new = self.activation.next_by(self.state.node_id)
        sent_at = time.monotonic()
        if not verdict.ok or not await self.zk.raise_activation(self.version, new):
            log.warning("ha: took the live lock but may not activate (%s): released", verdict.reason)
            await self.zk.release_lock()
            return False
        self._lease_sent_at = sent_at       # the raise's round trip proves the session alive then
        self.state.set_position(None, -1)   # its store follows no other broker's batches from here on
        self.activation, self.version = await self.zk.activation()
        log.warning("ha: node %s is live: activation %d (store at %d)", self.state.node_id, new.seq, stored)
        return True

    # ------------------------------------------------------------------ live

    async def _live(self) -> bool:
        """Run the broker until stopped (False) or demoted (True)."""
        from ..server.app import BrokerServer

        self.status = "live"
        self._leaving = False
        self._demoted.clear()
        self.fence = LiveFence(self.cfg.zookeeper_session_timeout, time.monotonic())
        self.fence.lease.renewed(self._lease_sent_at)
        server = self.server = BrokerServer(self.settings, self.loop, **self.server_options)
        server.ha = self
        server.guard = self.guard
        self.replication = ReplicationServer(self.cfg, server.store, self.loop, self._raise_again,
                                             self._raise_failed, self.server_tls)
        server.store.replica = self.replication
        timers: list[Any] = [self.loop.call_later(TICK, self._tick), self.loop.create_task(self._renew())]
        companion = self.companion_factory() if self.companion_factory is not None else None
        try:
            self._open_window("activated")
            if companion is not None:
                await companion.prepare(server)
            try:
                await server.start()   # (the lease is renewed meanwhile: recovery may take a while)
            except (OSError, StoreError) as exc:   # a port in use, a store it cannot open: not to be retried
                log.error("ha: cannot go live: %s", exc)
                self._leaving = True
                raise
            if self.fence.state is not LiveState.OPEN:
                server.close_listeners()   # fenced while starting: they open again once re-validated
            server.store.put_record("meta", ACTIVATION_KEY, str(self.activation.seq).encode())
            await self.replication.start()
            amqp = server.listeners[0]
            await self.zk.publish({"node": self.state.node_id, "replication": self.replication.address,
                                   "amqp": f"{amqp.host}:{amqp.port}"})
            if companion is not None:
                await companion.started(server)
            stop = self.loop.create_task(self.stopped.wait())
            demoted = self.loop.create_task(self._demoted.wait())
            timers += [stop, demoted]
            await asyncio.wait([stop, demoted], return_when=asyncio.FIRST_COMPLETED)
            return self._demoted.is_set() and not self.stopped.is_set()
        except ZkUnavailable as exc:   # publishing failed: ZooKeeper is in doubt
            log.warning("ha: ZooKeeper did not answer while going live (%s): a backup again", exc)
            self._demoted.set()
            return True
        except (OSError, StoreError):
            raise
        except Exception as exc:   # a bug: the traceback, and this broker steps down rather than exits
            log.error("ha: going live failed: %s: a backup again", exc, exc_info=exc)
            self._demoted.set()
            return True
        finally:
            self._leaving = True
            for t in timers:
                t.cancel()
            demoted = self._demoted.is_set()
            if demoted or self.fence.state is not LiveState.OPEN:
                self.fence.state = LiveState.DEMOTED     # nothing more is read or written
                self.replication.tracker.held = True
            await self.replication.close()
            if companion is not None:
                await companion.close()
            # A clean stop (SIGTERM) within the lease closes connections politely, the
            # window closing after the last word written.
            await server.stop(grace=0.5 if demoted else 5.0)
            self.fence.state = LiveState.DEMOTED
            self._close_window("stopped", None)
            self.server = None
            if demoted:
                try:
                    await self.zk.release_lock()   # when the session lives on: the lock is not ours to keep
                except ZkUnavailable:
                    pass

    def guard(self) -> bool:
        """Whether this broker may accept now: called by the server before it reads any
        input or writes any output.  The first look after a pause or past the lease
        fences at once (nothing of what waits on the sockets is read)."""
        fence = self.fence
        if fence.state is not LiveState.OPEN:
            return False
        why = fence.check(time.monotonic())
        if why is None:
            return True
        self._event(why)
        return False

    def _tick(self) -> None:
        if self.status != "live" or self.fence.state is LiveState.DEMOTED:
            return
        self.loop.call_later(TICK, self._tick)
        if self.fence.state is LiveState.OPEN:
            self.guard()

    async def _renew(self) -> None:
        """A ZooKeeper round trip every sixth of the session timeout: the lease."""
        while True:
            await asyncio.sleep(self.fence.lease.renew_every)
            if self.fence.state is not LiveState.OPEN or self.zk.state is not Session.CONNECTED:
                continue
            sent_at = time.monotonic()
            try:
                holds = await self.zk.holds_lock()
            except ZkUnavailable:
                continue   # the lease runs out on its own; kazoo reports the connection
            if holds:
                self.fence.lease.renewed(sent_at)
            self._event(LiveEvent.VALID if holds else LiveEvent.INVALID)

    async def _validate(self) -> None:
        """Is the lock still this session's, and the activation what this broker raised?"""
        while self.fence.state is LiveState.VALIDATING:
            sent_at = time.monotonic()
            try:
                holds = await self.zk.holds_lock()
                activation, version = await self.zk.activation()
            except ZkUnavailable as exc:
                if self.zk.state is Session.CONNECTED:   # slow, not gone: ask again
                    await asyncio.sleep(0.2)
                    continue
                log.info("ha: re-validation waits for ZooKeeper: %s", exc)
                self._event(LiveEvent.SUSPENDED)
                return
            if self.fence.state is not LiveState.VALIDATING:
                return
            valid = holds and activation == self.activation and version == self.version
            if valid:
                self.fence.lease.renewed(sent_at)
                self.fence.check(time.monotonic())   # the clock as of now: no stale gap
            else:
                log.warning("ha: re-validation failed: the lock is %s, the activation %d (this broker's %d)",
                            "this session's" if holds else "not this session's", activation.seq,
                            self.activation.seq)
            self._event(LiveEvent.VALID if valid else LiveEvent.INVALID)
            return

    def _session_changed(self, state: Session) -> None:
        if self.status == "live" and self.fence is not None:
            self._event(SESSION_TABLE[state].live_event)

    def _event(self, event: LiveEvent) -> None:
        """One row of LIVE_TABLE, carried out."""
        fence = self.fence
        before = fence.state
        row = fence.on(event)
        now = time.monotonic()
        style = fence.fence_style(row, now)
        if style is not Fence.NONE:
            self._fence(style, event)
        if row.state is not before:
            log.warning("ha: live broker %s -> %s (%s)", before.value, row.state.value, event.value)
        self.replication.tracker.held = row.state is not LiveState.OPEN
        if row.validate and not self._leaving:
            self.loop.create_task(self._validate())
        if row.reopen and not self._leaving:
            self._open_window("re-validated")   # from now on the guard lets things through
            self.loop.create_task(self._reopen())
        if row.state is LiveState.DEMOTED and before is not LiveState.DEMOTED:
            self._demoted.set()

    def _fence(self, style: Fence, event: LiveEvent) -> None:
        """Stop accepting now: the listener closes, every connection is closed with
        amqp:connection:forced (CLOSE: the lease still holds, what was decided may be
        written) or dropped with nothing written (ABORT)."""
        self.fenced_total += 1
        server = self.server
        server.close_listeners()
        if style is Fence.ABORT:
            self._close_window(event.value, self.fence.last_ok)
            server.abort_connections()
            return
        closing = list(server.protocols)
        server.close_connections("amqp:connection:forced", "the broker stopped accepting (high availability: "
                                                            "connect to the pair's other broker)")
        self._close_window(event.value, time.monotonic())   # after the last word written
        self.loop.call_later(CLOSE_GRACE, server.abort_connections, closing)

    async def _reopen(self) -> None:
        if self.fence.state is not LiveState.OPEN or self.server is None or self._leaving:
            return
        await self.server.reopen_listeners()
        self.replication.tracker.held = False
        self.server.store.replica_committed()

    def _open_window(self, why: str) -> None:
        self.windows += 1
        self._window_open = True
        log.warning("ha: accept window open: node=%s activation=%d at=%.6f (%s)", self.state.node_id,
                    self.activation.seq, time.time(), why)

    def _close_window(self, why: str, end: float | None) -> None:
        if not self._window_open:
            return
        self._window_open = False
        at = _wall(end) if end is not None else time.time()
        log.warning("ha: accept window closed: node=%s activation=%d at=%.6f (%s)", self.state.node_id,
                    self.activation.seq, at, why)

    # ------------------------------------------------------------------ going on alone

    async def _raise_again(self) -> int | None:
        """Going on without the backup (ha/primary.py): the next activation, or None
        when another broker changed it (it is live: this one is not)."""
        new = self.activation.next_by(self.state.node_id)
        sent_at = time.monotonic()
        if not await self.zk.raise_activation(self.version, new):
            return None
        self.fence.lease.renewed(sent_at)
        self.activation, self.version = await self.zk.activation()
        if self._window_open:   # the same window goes on under the new activation
            self._close_window("activation raised", time.monotonic())
            self._open_window("activation raised")
        return new.seq

    def _raise_failed(self, why: str, another_is_live: bool) -> None:
        log.error("ha: %s", why)
        if self.status == "live":
            self._event(LiveEvent.INVALID if another_is_live else LiveEvent.RAISE_FAILED)

    # ------------------------------------------------------------------ figures (management)

    def describe(self) -> dict:
        out = {"enabled": True, "node_id": self.state.node_id, "role": self.role.value, "status": self.status,
               "cluster": self.cfg.cluster, "activation": self.activation.seq,
               "accepting": self.status == "live" and self.fence is not None
               and self.fence.state is LiveState.OPEN,
               "store_complete": self.state.complete, "fenced_total": self.fenced_total,
               "demoted_total": self.demoted_total, "zookeeper": self.zk.describe()}
        if self.status == "live" and self.fence is not None:
            out["live"] = {"state": self.fence.state.value,
                           "lease_left": round(max(0.0, self.fence.lease.until - time.monotonic()), 3),
                           "accept_windows": self.windows}
        if self.status == "live" and self.replication is not None:
            out["replication"] = self.replication.describe()
        elif self.applier is not None:
            out["backup"] = self.applier.describe()
        return out


async def run_node(settings: Settings, loop: asyncio.AbstractEventLoop, config_file: Any = None,
                   overrides: dict | None = None,
                   companion_factory: Callable[[], LiveCompanion] | None = None) -> int:
    """cli.py's entry with [ha]: until SIGTERM / SIGINT.  Exits only for what cannot
    be waited out (a bad configuration, a store that cannot be opened)."""
    from ..server.app import install_signal_handlers

    stopped = asyncio.Event()
    install_signal_handlers(loop, stopped.set)
    try:
        node = HaNode(settings, loop, stopped)
        node.server_options = {"config_file": config_file, "overrides": overrides}   # live reload
        node.companion_factory = companion_factory
        return await node.run()
    except (ValueError, OSError, StoreError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except Exception as exc:   # a bug: the traceback, and the supervisor restarts it
        log.critical("ha: the node failed: %s", exc, exc_info=exc)
        return 2
