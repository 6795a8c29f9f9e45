"""The ZooKeeper side of the pair (kazoo): the live lock, the activation sequence,
the session's state and the live broker's lease.

Layout under /amqpbroker/<cluster>:
  live         ephemeral: who is live (JSON: node, replication address, amqp address).
               The lock recipe without a queue (ZooKeeper recipes, "Locks"): whoever
               creates it holds it; it goes with its holder's session, so a broker
               killed or cut off loses it one session timeout later.
  activation   persistent: "<seq> <owner>" (core/ha.py Activation), changed only by a
               compare-and-set on the node's version.

kazoo runs its own threads.  Nothing here blocks the loop or parks an executor
thread: every request is kazoo's asynchronous form, its completion brought back to
the loop (call_soon_threadsafe) and awaited with a timeout — a request made while
ZooKeeper is away is simply answered late or never, and the caller is told
ZkUnavailable.  The session is never given up: kazoo reconnects (at most a second
apart) and makes a new session when the old one expired; every change of state is
logged once and passed on (core/ha.py Session, SESSION_TABLE).  Nothing imports
kazoo unless [ha] is configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from ..config import HaConfig
from ..core.ha import Activation, Session

log = logging.getLogger("amqpbroker.ha")

REQUEST_TIMEOUT_SHARE = 0.5   # of the session timeout: a request not answered by then counts as lost


class ZkUnavailable(Exception):
    """ZooKeeper did not answer (connection lost, session expired, timed out)."""


class ZkSession:
    def __init__(self, cfg: HaConfig, loop: asyncio.AbstractEventLoop,
                 on_state: Callable[[Session], None] | None = None):
        from kazoo.client import KazooClient   # only with [ha]: the embedded broker never loads it
        from kazoo.retry import KazooRetry

        self.cfg = cfg
        self.loop = loop
        self.root = f"/amqpbroker/{cfg.cluster}"
        self.live_path = f"{self.root}/live"
        self.activation_path = f"{self.root}/activation"
        # Reconnect forever, never more than a second apart (kazoo's default backs off to an hour).
        retry = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=1.0)
        self.client = KazooClient(hosts=cfg.zookeeper, timeout=cfg.zookeeper_session_timeout,
                                  connection_retry=retry)
        self.state = Session.CONNECTING
        self.since = time.time()
        self.changes: dict[str, int] = {s.value: 0 for s in Session}
        self.session_hex: str | None = None
        self.on_state = on_state
        self.request_timeout = max(1.0, cfg.zookeeper_session_timeout * REQUEST_TIMEOUT_SHARE)
        if logging.getLogger("amqpbroker").getEffectiveLevel() > logging.DEBUG:
            # kazoo logs every reconnect attempt; the pair logs each state once instead.
            logging.getLogger("kazoo").setLevel(logging.ERROR)
        self.client.add_listener(self._listener)

    # ---- session
    def _listener(self, state: Any) -> None:   # kazoo's thread: never block here
        self.loop.call_soon_threadsafe(self._state_changed, Session(str(state)))

    def _state_changed(self, state: Session) -> None:
        if state is self.state:
            return
        self.state = state
        self.since = time.time()
        self.changes[state.value] += 1
        if state is Session.CONNECTED:
            sid = self.session_id
            new = f"{sid:#x}" if sid is not None else "?"
            kind = "a new session" if new != self.session_hex else "the same session"
            self.session_hex = new
            log.info("ha: ZooKeeper session CONNECTED (%s %s)", kind, new)
        elif state is Session.SUSPENDED:
            log.warning("ha: ZooKeeper session SUSPENDED: the connection is lost, the session may live on")
        else:
            log.warning("ha: ZooKeeper session LOST: it expired (or was closed); a new one is made on reconnect")
        if self.on_state is not None:
            self.on_state(state)

    def start(self) -> None:
        """Connect in the background (a ZooKeeper that is away is no reason to stop:
        the node waits as a backup; the state listener says when it is connected)."""
        log.info("ha: ZooKeeper session CONNECTING to %s", self.cfg.zookeeper)
        self.client.start_async()

    async def stop(self) -> None:
        """Closing the session deletes the live node at once (no session timeout to wait)."""
        def close() -> None:
            try:
                self.client.stop()
                self.client.close()
            except Exception as exc:   # ZooKeeper gone: its session expires on its own
                log.warning("ha: closing the ZooKeeper session: %s", exc)
        await self.loop.run_in_executor(None, close)

    @property
    def session_id(self) -> int | None:
        cid = self.client.client_id
        return cid[0] if cid else None

    def describe(self) -> dict:
        return {"hosts": self.cfg.zookeeper, "session": self.state.value, "session_id": self.session_hex,
                "since": round(self.since, 3), "session_timeout": self.cfg.zookeeper_session_timeout,
                "changes": dict(self.changes)}

    # ---- requests
    async def _request(self, start: Callable[[], Any]) -> Any:
        """Issue a kazoo asynchronous request (non-blocking) and await its answer."""
        from kazoo.exceptions import KazooException, NoNodeError, NodeExistsError, BadVersionError
        if self.state is not Session.CONNECTED:
            raise ZkUnavailable(f"ZooKeeper session {self.state.value}")
        future = self.loop.create_future()

        def done(result: Any) -> None:   # kazoo's thread
            self.loop.call_soon_threadsafe(_settle, future, result)

        try:
            start().rawlink(done)
        except Exception as exc:
            raise ZkUnavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            return await asyncio.wait_for(future, self.request_timeout)
        except asyncio.TimeoutError:
            raise ZkUnavailable(f"no answer from ZooKeeper in {self.request_timeout:.1f} s") from None
        except (NoNodeError, NodeExistsError, BadVersionError):
            raise
        except KazooException as exc:   # ConnectionLoss, SessionExpiredError, ...
            raise ZkUnavailable(f"{type(exc).__name__}: {exc}") from None

    # ---- the activation sequence
    async def activation(self) -> tuple[Activation, int]:
        """(the activation, the node's version; -1: no node yet)."""
        from kazoo.exceptions import NoNodeError
        try:
            data, stat = await self._request(lambda: self.client.get_async(self.activation_path))
        except NoNodeError:
            return Activation(), -1
        return Activation.decode(data), stat.version

    async def raise_activation(self, version: int, new: Activation) -> bool:
        """Compare-and-set: False when someone else changed it since `version` was read."""
        from kazoo.exceptions import BadVersionError, NodeExistsError
        try:
            if version < 0:
                await self._request(lambda: self.client.create_async(self.activation_path, new.encode(),
                                                                     makepath=True))
            else:
                await self._request(lambda: self.client.set_async(self.activation_path, new.encode(), version))
        except (BadVersionError, NodeExistsError):
            return False
        return True

    # ---- the live lock
    async def try_lock(self, info: dict) -> bool:
        from kazoo.exceptions import NodeExistsError
        try:
            await self._request(lambda: self.client.create_async(self.live_path, json.dumps(info).encode(),
                                                                 ephemeral=True, makepath=True))
        except NodeExistsError:
            return False
        return True

    async def publish(self, info: dict) -> None:
        """What the backup needs to find the live broker (its lock node's data), written
        only while this session holds the lock: a broker paused between taking the lock
        and publishing must not overwrite the data of the broker that took it over
        (whose backup would then look for the live broker at the wrong address)."""
        from kazoo.exceptions import BadVersionError, NoNodeError
        stat = await self._held_lock()
        if stat is None:
            raise ZkUnavailable("the live lock is not this session's any more (the session expired)")
        try:
            await self._request(lambda: self.client.set_async(self.live_path, json.dumps(info).encode(),
                                                              stat.version))
        except (NoNodeError, BadVersionError):
            raise ZkUnavailable("the live lock changed while it was being published") from None

    async def release_lock(self) -> None:
        """Give the live lock back, only while this session holds it.  ZooKeeper lets
        any session delete any node: a live broker paused until the backup took over,
        demoted once it woke up (its new session connected by then), deleted the lock
        the new live broker held, which then failed its next lease renewal and stepped
        down too, leaving the pair with no live broker (docs/ha.md, "Fault cases")."""
        from kazoo.exceptions import BadVersionError, NoNodeError
        stat = await self._held_lock()
        if stat is None:
            return
        try:
            # Ours when asked; the version makes the delete miss a node made again since.
            await self._request(lambda: self.client.delete_async(self.live_path, stat.version))
        except (NoNodeError, BadVersionError):
            pass

    async def live(self) -> tuple[dict | None, bool]:
        """(the live broker's published data or None, whether this session holds it)."""
        from kazoo.exceptions import NoNodeError
        try:
            data, stat = await self._request(lambda: self.client.get_async(self.live_path))
        except NoNodeError:
            return None, False
        try:
            info = json.loads(data) if data else {}
        except ValueError:
            info = {}
        return info, stat.ephemeralOwner == self.session_id

    async def holds_lock(self) -> bool:
        """Whether the live node exists and belongs to this session (a lease renewal:
        a round trip to the server that proves the session alive when it was sent)."""
        return await self._held_lock() is not None

    async def _held_lock(self) -> Any:
        """The live node's stat when this session holds it, else None."""
        stat = await self._request(lambda: self.client.exists_async(self.live_path))
        return stat if stat is not None and stat.ephemeralOwner == self.session_id else None


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if result.successful():
        future.set_result(result.value)
    else:
        future.set_exception(result.exception)
