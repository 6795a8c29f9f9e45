"""Operations running inside the broker: the management listener (FastAPI on
uvicorn, on the broker's own asyncio loop), the rate sampler and the idle-expiry
policy runner.  Started by `BrokerServer.start`, stopped by `BrokerServer.stop`.

Everything that reads the broker runs on its loop, a slice at a time where it visits
every queue (pacing.py); sorting, rendering and encoding of the plain copies runs in
one worker thread (`off_loop`), so a scrape of 50,000 queues does not stall AMQP.
One worker: what it does is CPU-bound Python and competes with the loop for the
GIL, so more workers would only take more from the loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..config import is_loopback
from ..security.throttle import auth_throttle
from .admin import Admin, AdminError
from .auth import Authenticator
from .expiry import DELETE, ExpiryAction, ExpiryRule, ExpiryTracker, evaluate
from .messages import MessageOps
from .metrics import Metrics
from .http_server import embedded_server
from .port import ManagedBroker

log = logging.getLogger("amqpbroker.management")

RATE_INTERVAL = 5.0

R = TypeVar("R")


class Operations:
    def __init__(self, managed: ManagedBroker, clock: Callable[[], float] = time.time):
        self.managed = managed
        self.settings = managed.settings
        self.clock = clock
        # The broker's own (shared with SASL: one record per address), or one of ours.
        self.auth_throttle = getattr(managed, "auth_throttle", None) or auth_throttle(self.settings)
        self.http_auth_failures = 0
        self._executor: ThreadPoolExecutor | None = None
        self.admin = Admin(managed, clock, self.off_loop)
        self.messages = MessageOps(self.admin)
        self.authenticator = Authenticator(self)
        self.metrics = Metrics(self)
        self.expiry_rules = [ExpiryRule(p.pattern, p.idle, p.max_backlog, p.action, p.match)
                             for p in self.settings.expiry_policies]
        self.expiry_tracker = ExpiryTracker()
        self.expiry_actions: dict[str, int] = {}        # action → count (metrics)
        self.host: str | None = None
        self.port: int | None = None
        self._http: Any = None
        self._http_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._expiry_task: asyncio.Task | None = None

    @property
    def auth_failures(self) -> int:
        """Failed HTTP basic authentications (wrong password, unknown user, garbage)."""
        return self.http_auth_failures

    async def off_loop(self, fn: Callable[..., R], *args: Any, **kw: Any) -> R:
        """fn(*args, **kw) in the management worker thread.  Only for plain data:
        never a live broker object (the loop changes those meanwhile)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="amqpbroker-mgmt")
        return await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                functools.partial(fn, *args, **kw))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        loop = self.managed.loop
        if self.settings.management.enabled:
            await self._start_http()
        self._tasks.append(loop.create_task(self._every(RATE_INTERVAL, self.admin.sample_rates_paced)))
        if self.expiry_rules:
            self._start_expiry()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._expiry_task = None
        if self._http is not None:
            self._http.should_exit = True
            try:
                await asyncio.wait_for(self._http_task, 5.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 — shutting down regardless
                self._http_task.cancel()
            self._http = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _every(self, interval: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                result = fn()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a bad run must not end the periodic task
                log.exception("periodic %s failed", getattr(fn, "__name__", fn))

    # ------------------------------------------------------------------ HTTP

    async def _start_http(self) -> None:
        import uvicorn

        from .api import build_app

        m = self.settings.management
        family = socket.AF_INET6 if ":" in m.host else socket.AF_INET
        try:
            sock = socket.create_server((m.host, m.port), family=family, backlog=128)
        except OSError as exc:
            raise OSError(f"management listener on {m.host}:{m.port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        config = uvicorn.Config(
            build_app(self), loop="none", lifespan="off", log_config=None, access_log=False,
            ws="none", server_header=False, timeout_graceful_shutdown=2,
            ssl_certfile=str(m.cert_file) if m.cert_file else None,
            ssl_keyfile=str(m.key_file) if m.key_file else None)
        server = embedded_server(config)
        self._http = server
        self._http_task = self.managed.loop.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._http_task.done():
                exc = self._http_task.exception()
                raise OSError(f"management listener failed to start: {exc}")
            await asyncio.sleep(0.005)
        self.host, self.port = m.host, sock.getsockname()[1]
        log.info("management listening on %s:%d (%s)", self.host, self.port,
                 "https" if m.cert_file else "http")
        if not is_loopback(m.host):
            self._warn_unreachable(m.host)

    def _warn_unreachable(self, host: str) -> None:
        """A listener on the network that no one outside may use says so, and how
        to change that (a container publishing 8161 reaches nothing otherwise)."""
        access = self.managed.access
        how = ("add a user and an [[acl]] rule granting manage, e.g. AMQPBROKER_USERS__ADMIN__PASSWORD="
               "<from `amqpbroker hash-password`> and AMQPBROKER_ACL='[{\"user\": \"admin\", "
               "\"permissions\": [\"manage\"]}]' (with ACLs on, AMQP users need rules too: "
               "docs/deploy.md)")
        if not access.enabled:
            log.warning("management API on %s answers loopback clients only: no access control "
                        "([[acl]]) is configured; to manage from elsewhere, %s", host, how)
            return
        users = self.settings.users
        if not any(access.policy.can_manage_any(name, u.groups) for name, u in users.items()) \
                and not access.policy.can_manage_any(None, ()):
            log.warning("management API on %s: no user has the manage permission, every request "
                        "is refused; %s", host, how)

    # ------------------------------------------------------------------ live reload

    async def reload(self, who: str, allow_open: bool = False) -> dict:
        """POST /api/reload: the broker re-reads its configuration (a bad file changes
        nothing: 400 with the reason; so does one that opens access unless
        `allow_open`)."""
        log.info("admin: configuration reload requested by %s%s", who, " (allow open)" if allow_open else "")
        try:
            return await self.managed.reload_config(who, allow_open)
        except ValueError as exc:
            raise AdminError(f"configuration not reloaded, nothing changed: {exc}", 400) from None

    def reloaded(self) -> None:
        """The broker took a new configuration: expiry policies from it, and HTTP
        credentials checked again (a removed user or a changed password must not
        live on in the one-minute cache)."""
        self.expiry_rules = [ExpiryRule(p.pattern, p.idle, p.max_backlog, p.action, p.match)
                             for p in self.settings.expiry_policies]
        self.expiry_tracker = ExpiryTracker()
        self.authenticator.forget()
        if self.expiry_rules and self._expiry_task is None and self._tasks:
            self._start_expiry()

    def _start_expiry(self) -> None:
        self._expiry_task = self.managed.loop.create_task(self._every(self.settings.expiry_interval,
                                                                      self.run_expiry))
        self._tasks.append(self._expiry_task)

    # ------------------------------------------------------------------ expiry policy

    def run_expiry(self, now: float | None = None) -> list[ExpiryAction]:
        """Evaluate every durable subscription against the policies; log, count and
        (action delete) remove.  Returns the actions carried out this run."""
        now = self.clock() if now is None else now
        admin = self.admin
        subs = {admin.subscription_state(s).ident: s for s in list(admin.registry.by_queue.values())
                if s.durable}
        states = [admin.subscription_state(s) for s in subs.values()]
        done = []
        for act in self.expiry_tracker.due(evaluate(self.expiry_rules, states, now)):
            if act.action == DELETE:
                sub = subs[act.sub.ident]
                try:
                    admin.delete_subscription(act.sub.name, act.sub.namespace, True,
                                              reason=f"expiry policy '{act.rule.pattern}'")
                except AdminError as exc:
                    log.warning("expiry policy: could not delete subscription '%s': %s",
                                sub.key.name if sub.key else sub.queue_name, exc.message)
                    continue
                log.warning("expiry policy: deleted %s", act.describe())
            else:
                log.warning("expiry policy: abandoned %s", act.describe())
            self.expiry_actions[act.action] = self.expiry_actions.get(act.action, 0) + 1
            done.append(act)
        return done
