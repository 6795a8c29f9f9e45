"""The ZooKeeper side of the pair (kazoo): the live lock and the activation sequence.

Layout under /amqpbroker/<cluster>:
  live         ephemeral: who is live (JSON: node, replication address, amqp address).
               The lock recipe without a queue (ZooKeeper recipes, "Locks"): whoever
               creates it holds it; it goes with its holder's session, so a broker
               killed or cut off loses it one session timeout later.
  activation   persistent: "<seq> <owner>" (core/ha.py Activation), changed only by a
               compare-and-set on the node's version.

kazoo runs its own threads; every blocking call here runs in the loop's default
executor, and session state changes come back to the loop with
call_soon_threadsafe.  Nothing imports kazoo unless [ha] is configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from ..config import HaConfig
from ..core.ha import Activation

log = logging.getLogger("amqpbroker.ha")


class ZkSession:
    def __init__(self, cfg: HaConfig, loop: asyncio.AbstractEventLoop,
                 on_state: Callable[[str], None] | None = None):
        from kazoo.client import KazooClient   # only with [ha]: the embedded broker never loads it

        self.cfg = cfg
        self.loop = loop
        self.root = f"/amqpbroker/{cfg.cluster}"
        self.live_path = f"{self.root}/live"
        self.activation_path = f"{self.root}/activation"
        self.client = KazooClient(hosts=cfg.zookeeper, timeout=cfg.zookeeper_session_timeout)
        self.state = "LOST"
        self.on_state = on_state
        self.client.add_listener(self._listener)

    # ---- session
    def _listener(self, state: Any) -> None:   # kazoo's thread: never block here
        self.loop.call_soon_threadsafe(self._state_changed, str(state))

    def _state_changed(self, state: str) -> None:
        if state != self.state:
            log.warning("ha: ZooKeeper session %s", state) if state != "CONNECTED" else \
                log.info("ha: ZooKeeper session CONNECTED")
        self.state = state
        if self.on_state is not None:
            self.on_state(state)

    async def _call(self, fn: Callable, *args: Any) -> Any:
        return await self.loop.run_in_executor(None, fn, *args)

    async def start(self, timeout: float = 15.0) -> None:
        await self._call(lambda: self.client.start(timeout))
        self.state = "CONNECTED"
        await self._call(self.client.ensure_path, self.root)

    async def stop(self) -> None:
        """Closing the session deletes the live node at once (no session timeout to wait)."""
        try:
            await self._call(self.client.stop)
            await self._call(self.client.close)
        except Exception as exc:   # ZooKeeper gone: its session expires on its own
            log.warning("ha: closing the ZooKeeper session: %s", exc)

    @property
    def session_id(self) -> int | None:
        cid = self.client.client_id
        return cid[0] if cid else None

    # ---- the activation sequence
    async def activation(self) -> tuple[Activation, int]:
        """(the activation, the node's version; -1: no node yet)."""
        from kazoo.exceptions import NoNodeError
        try:
            data, stat = await self._call(self.client.get, self.activation_path)
        except NoNodeError:
            return Activation(), -1
        return Activation.decode(data), stat.version

    async def raise_activation(self, version: int, new: Activation) -> bool:
        """Compare-and-set: False when someone else changed it since `version` was read."""
        from kazoo.exceptions import BadVersionError, NodeExistsError
        try:
            if version < 0:
                await self._call(lambda: self.client.create(self.activation_path, new.encode()))
            else:
                await self._call(lambda: self.client.set(self.activation_path, new.encode(), version))
        except (BadVersionError, NodeExistsError):
            return False
        return True

    # ---- the live lock
    async def try_lock(self, info: dict) -> bool:
        from kazoo.exceptions import NodeExistsError
        try:
            await self._call(lambda: self.client.create(self.live_path, json.dumps(info).encode(),
                                                        ephemeral=True))
        except NodeExistsError:
            return False
        return True

    async def publish(self, info: dict) -> None:
        """What the backup needs to find the live broker (its lock node's data)."""
        await self._call(lambda: self.client.set(self.live_path, json.dumps(info).encode()))

    async def release_lock(self) -> None:
        from kazoo.exceptions import NoNodeError
        try:
            await self._call(self.client.delete, self.live_path)
        except NoNodeError:
            pass

    async def live(self) -> tuple[dict | None, bool]:
        """(the live broker's published data or None, whether this session holds it)."""
        from kazoo.exceptions import NoNodeError
        try:
            data, stat = await self._call(self.client.get, self.live_path)
        except NoNodeError:
            return None, False
        try:
            info = json.loads(data) if data else {}
        except ValueError:
            info = {}
        return info, stat.ephemeralOwner == self.session_id
