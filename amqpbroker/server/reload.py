"""Live reload, the I/O side: read and validate the file, ask security/reload.py
what changes, apply it to the running broker without dropping connections.

All or nothing:

* the file is read once, and those bytes are what is parsed and validated
  (settings, the user store, the ACL policy), whole, before anything running is
  touched; a bad file changes nothing, and the refusal says why;
* it is read again `SETTLE` seconds later: a file that changed meanwhile is being
  written (an editor, `cp`) and is not taken;
* a file that would open access (security/reload.py `opens_access`: access control
  turned off, every user removed, more for the anonymous identity) is not taken
  unless the request says so (`allow_open`: `amqpbroker admin reload --allow-open`,
  `POST /api/reload?allow_open=true`; a SIGHUP never does).

One reload at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from proton import Condition

from ..config import ConfigError, Settings, load_settings
from ..core.limits import LimitRule
from ..security.guard import groups_from, policy_from
from ..security.reload import (UNAUTHORIZED, LiveConnection, LiveLink, ReloadError, ReloadPlan, opens_access,
                               plan)
from ..security.users import UserStore, users_from
from .links import link_key
from .terminus import read_source, read_target

if TYPE_CHECKING:
    from .ports import ReloadTarget

log = logging.getLogger("amqpbroker")

CLOSE_GRACE = 5.0   # seconds a closed connection's peer has to answer before its socket goes
SETTLE = 0.25       # seconds between the two reads of the file (a file being written differs)


def _no_wait(path: str, flags: int) -> int:
    """open(2) that does not wait for a FIFO's writer (the file is checked after)."""
    return os.open(path, flags | os.O_NONBLOCK)


class ConfigReloader:
    def __init__(self, server: "ReloadTarget", config_file: Path | None, overrides: dict[str, Any], *,
                 settle: float = SETTLE, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        self.server = server
        self.config_file = config_file
        self.overrides = overrides
        self.settle = settle
        self.sleep = sleep
        self.reloads = 0           # taken
        self.refused = 0           # bad files, files being written, access opened unasked
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    async def reload(self, who: str, allow_open: bool = False) -> dict:
        """Re-read the file and apply what changed; ReloadError (nothing changed) when
        it is not valid, still being written, or opens access unasked.  Logged either way."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                new, users, policy = await self.read_settled()
                opening = opens_access(self.server.settings, new, self.server.access.policy, policy)
                if opening and not allow_open:
                    raise ReloadError(f"the new configuration is not taken: {'; and '.join(opening)}. "
                                      "The running users and rules stay. If that is meant, reload with "
                                      "`amqpbroker admin reload --allow-open` (POST /api/reload?allow_open=true); "
                                      "a SIGHUP never opens access")
            except ReloadError as exc:
                self.refused += 1
                log.error("configuration reload by %s refused, nothing changed: %s", who, exc)
                raise
            return self._take(who, new, users, policy, opening)

    def _take(self, who: str, new: Settings, users: UserStore, policy: Any, opening: list[str]) -> dict:
        source = str(self.config_file) if self.config_file else "the environment"
        server = self.server
        p = plan(server.settings, new, policy, self._connections(), self._links(), self._queues())
        p.opened = opening
        self._apply(new, users, policy, p)
        self.reloads += 1
        (log.warning if p.restart_needed or opening else log.info)(
            "configuration reloaded from %s by %s: %s", source, who, p.describe())
        return {"source": source, **p.summary()}

    def on_signal(self) -> None:
        """SIGHUP: a reload in its own task (it waits SETTLE between its two reads)."""
        task = self.server.loop.create_task(self._signal_reload())
        self._tasks.add(task)                 # held until done (the loop keeps weak references)
        task.add_done_callback(self._tasks.discard)

    async def _signal_reload(self) -> None:
        try:
            await self.reload("SIGHUP")
        except ReloadError:
            pass   # logged

    # ------------------------------------------------------------------ validate

    def _read(self) -> str | None:
        """The file's text.  Only a regular file: a FIFO put in its place (or a device)
        would wait for a writer, and the reading thread with it."""
        if self.config_file is None:
            return None
        try:
            with open(self.config_file, "rb", opener=_no_wait) as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise ReloadError(f"cannot read config {self.config_file}: not a regular file")
                return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ReloadError(f"cannot read config {self.config_file}: {exc}") from None

    async def _read_off_loop(self) -> str | None:
        """`_read` in a worker thread: a file system that hangs (a network mount) holds
        the reload, never the broker's loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self._read)

    async def read_settled(self) -> tuple[Settings, UserStore, Any]:
        """The file, read once, validated whole; then read again after `settle`
        seconds: a file that changed meanwhile is still being written."""
        text = await self._read_off_loop()
        loaded = self._load(text)
        if text is not None and self.settle > 0:
            await self.sleep(self.settle)
            if await self._read_off_loop() != text:
                raise ReloadError(f"{self.config_file} changed while it was read (still being written?); "
                                  "reload again once it is complete")
        return loaded

    def _load(self, text: str | None) -> tuple[Settings, UserStore, Any]:
        try:
            new = load_settings(self.config_file, text=text, **self.overrides)
        except ConfigError as exc:
            raise ReloadError(str(exc)) from None
        try:
            users = users_from(new.users)
        except ValueError as exc:
            raise ReloadError(f"invalid setting 'users': {exc}") from None
        try:
            policy = policy_from(new)
        except ValueError as exc:
            raise ReloadError(f"invalid setting 'acl': {exc}") from None
        return new, users, policy

    # ------------------------------------------------------------------ what is live

    def _connections(self) -> list[LiveConnection]:
        return [LiveConnection(h, h.protocol.user, f"{h.protocol.peer}, container '{h.container_id}'")
                for hs in self.server.handlers_by_container.values() for h in hs if not h.ended]

    def _links(self) -> list[LiveLink]:
        access = self.server.access
        out = []
        for (container, name, is_sender), (handler, link) in list(self.server.live_links.items()):
            if handler.ended or link.state & link.LOCAL_CLOSED:
                continue
            if is_sender:
                need = access.consumer_requirement(read_source(link.remote_source), name, container)
            else:
                need = access.producer_requirement(read_target(link.remote_target))
            if need is not None:
                member = getattr(handler.endpoints.get(link_key(link)), "served_as", None)
                out.append(LiveLink((handler, link), handler, handler.protocol.user, name, *need,
                                    also=(member,) if member else ()))
        return out

    def _queues(self) -> dict:
        return {name: (q.limits, q.declared_limits) for name, q in self.server.broker.queues.items()}

    # ------------------------------------------------------------------ apply

    def _apply(self, new: Settings, users: UserStore, policy: Any, p: ReloadPlan) -> None:
        server = self.server
        s = server.settings
        for name in ("users", "acl", "anonymous", "expiry_policies", "queue_limits", "queues"):
            setattr(s, name, getattr(new, name))
        server.users = users
        server.access.reconfigure(policy, groups_from(new))
        server.broker.policy.queue_limits = tuple(LimitRule(r.pattern, r.queue_limits()) for r in new.queue_limits)
        for name, (declared, effective) in p.queue_limits.items():
            server.broker.queues[name].set_limits(effective, declared)
        server.operations.reloaded()
        for conn, why in p.close:
            self._close(conn, why)
        for link, why in p.detach:
            self._detach(link, why)
        server.flush_soon()

    def _close(self, conn: LiveConnection, why: str) -> None:
        h = conn.ref
        log.warning("connection %s closed: %s: %s", conn.description, UNAUTHORIZED, why)
        h.conn.condition = Condition(UNAUTHORIZED, why)
        h.conn.close()
        h.protocol.mark_dirty()
        proto, protocols = h.protocol, self.server.protocols
        # A peer that never answers the close loses its socket anyway.
        self.server.loop.call_later(CLOSE_GRACE, lambda: proto.abort() if proto in protocols else None)

    def _detach(self, live: LiveLink, why: str) -> None:
        handler, link = live.ref
        log.warning("connection %s: link '%s' detached: %s: %s", handler.protocol.peer, live.name,
                    UNAUTHORIZED, why)
        link.condition = Condition(UNAUTHORIZED, why)
        link.close()
        handler.link_ended(link)          # releases its deliveries (AMQP 1.0 §2.6.6), as a broker-ended link
        self.server.forget_link(handler, link)
        handler.protocol.mark_dirty()


__all__ = ["ConfigReloader", "ReloadError"]
