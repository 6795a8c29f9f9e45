"""The running broker: listeners, connection admission, link ownership, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from proton import Condition, Link

from ..config import ClientIdPolicy, Settings, anonymous_allowed, plain_allowed
from ..core.alarms import Alarms
from ..core.broker import Broker, BrokerPolicy
from ..core.budget import MemoryBudget
from ..core.handshakes import HandshakeGate
from ..core.limits import LimitRule, limits_for
from ..core.registry import SubscriptionRegistry, subscription_filter
from ..core.transactions import TransactionRegistry
from ..looptrace import TRACE
from ..security.guard import UNAUTHORIZED, AccessGuard
from ..security.certs import CertIdentities, peer_certificate
from ..security.throttle import auth_throttle
from ..security.users import users_from
from ..store.base import Store
from ..store.durability import DurabilityManager
from ..store.lmdb_store import LmdbStore
from .alarm_watch import AlarmWatch
from .engine import AmqpProtocol
from .flow import FlowGate
from .handlers import ConnectionHandler
from .peer_fields import symbols
from .ports import ClusterPort
from .resources import ResourceWatch
from .refusal import AttachRefused
from .reload import ConfigReloader
from .tls import server_context, tls_protocol_factory
from .websocket import WebSocketAmqp
from .sasl import SaslPolicy

log = logging.getLogger("amqpbroker")

ALL_MECHANISMS = ("SCRAM-SHA-256", "PLAIN", "ANONYMOUS")


@dataclass
class Listener:
    name: str
    host: str
    port: int
    sasl_policy: SaslPolicy
    client_id_policy: ClientIdPolicy
    ssl_context: ssl.SSLContext | None = None
    server: asyncio.AbstractServer | None = None
    # The user a verified client certificate names (SASL EXTERNAL): security/certs.py.
    cert_identity: CertIdentities | None = None
    websocket: bool = False    # AMQP over WebSocket (server/websocket.py)

    def external_identity(self, sock: Any) -> Any:
        if self.cert_identity is None:
            return None
        return self.cert_identity.identify(peer_certificate(sock))


class BrokerServer:
    # The composition point of a connection: its engine (engine.AmqpProtocol) hands
    # its events to what this builds, named there through ports.ConnectionServer.
    make_handler = ConnectionHandler

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop | None = None, *,
                 config_file: Path | None = None, overrides: dict[str, Any] | None = None):
        self.settings = settings
        self.loop = loop or asyncio.get_event_loop()
        p = settings.policy
        self.broker = Broker(BrokerPolicy(
            auto_create_queues=p.auto_create_queues,
            max_delivery_attempts=p.max_delivery_attempts,
            dead_letter_address=p.dead_letter_address,
            max_consumers_per_subscription=p.max_consumers_per_subscription,
            max_queues_per_user=p.max_queues_per_user,
            queue_limits=tuple(LimitRule(r.pattern, r.queue_limits()) for r in settings.queue_limits),
        ))
        self.broker.defer = self.loop.call_soon   # queues dispatch in slices, one per loop turn
        if settings.store.enabled:   # queued messages in memory, all queues together (core/budget.py)
            self.broker.budget = MemoryBudget(settings.store.memory_budget)
        self.subscriptions = SubscriptionRegistry(self.broker, subscription_filter)
        self.transactions = TransactionRegistry()
        st = settings.store
        self.store: Store = (LmdbStore(settings.data_dir / "store", map_size=st.initial_map_size,
                                       max_map_size=st.max_map_size, verify=st.verify_at_start)
                             if st.enabled else Store())
        self.durability = DurabilityManager(self.broker, self.subscriptions, self.store,
                                            memory_budget=st.queue_memory_budget)
        # Users without a password authenticate by TLS client certificate only (EXTERNAL).
        self.users = users_from(settings.users)
        self.listeners: list[Listener] = []
        self.protocols: set[AmqpProtocol] = set()
        self.handlers_by_container: dict[str, list[Any]] = {}
        self.live_links: dict[tuple[str, str, bool], tuple[Any, Link]] = {}
        self.dirty: list[AmqpProtocol] = []
        self._flush_scheduled = False
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at: float | None = None
        self.metrics_refused: dict[str, int] = {}
        self.metrics_auth_failures = 0
        self.connection_count = 0
        self.stopping = False
        self.access = AccessGuard(settings, self.broker, self.subscriptions)   # [[acl]], [anonymous]
        lim = settings.limits
        self.handshakes = HandshakeGate(lim.max_handshakes, lim.max_handshakes_per_address)
        self.auth_throttle = auth_throttle(settings)   # SASL and the management API alike
        self._refusals_logged_at = 0.0
        self._refusals_unlogged = 0
        self.resources = ResourceWatch(self.loop, self.protocols)   # descriptors, memory after bursts
        al = settings.alarms   # memory and disk alarms: while raised, producers get no new credit
        self.alarms = Alarms(al.memory_high_watermark, al.memory_high_watermark_absolute, al.disk_free_limit,
                             disk_enabled=st.enabled)
        self.alarm_watch = AlarmWatch(self.loop, self.alarms, settings.data_dir / "store" if st.enabled else None,
                                      al.check_interval)
        self.flow = FlowGate(self.loop, self.broker, self.alarms, self.transactions)   # producers' credit
        self.ha: Any = None   # with [ha]: the pair's node (amqpbroker/ha/node.py), for management
        # In a cluster (amqpbroker/cluster): forwarding to the nodes that own other
        # addresses (server/ports.py ClusterPort); None alone, and nothing of it loads.
        self.cluster: ClusterPort | None = None
        self.reuse_port = False   # SO_REUSEPORT on the AMQP listeners (serve --workers)
        # With [ha]: whether this broker may accept now (ha/node.py HaNode.guard), asked
        # before any input is read and any output written; None: always.
        self.guard: Callable[[], bool] | None = None
        from ..management.service import Operations
        self.operations = Operations(self)                  # management API, metrics, expiry policy
        # Live reload of users, ACLs, expiry policies, queue limits (SIGHUP, POST /api/reload).
        self.reloader = ConfigReloader(self, config_file, overrides or {})

    # ------------------------------------------------------------------ set-up

    def _declare_configured(self) -> None:
        b = self.broker
        for ex in self.settings.exchanges:
            b.declare_exchange(ex.name, ex.type, ex.durable)
        for q in self.settings.queues:
            declared = q.queue_limits()
            queue = b.declare_queue(q.name, durable=q.durable, max_delivery_attempts=q.max_delivery_attempts,
                                    limits=declared)
            # A recovered queue: limits in the config win; else those it was declared
            # with (kept in its store record), else a pattern's.
            if declared is not None:
                queue.declared_limits = declared
            queue.limits = limits_for(q.name, b.policy.queue_limits, queue.declared_limits)
        for bd in self.settings.bindings:
            if bd.exchange not in b.exchanges or bd.queue not in b.queues:
                raise ValueError(f"binding {bd.exchange} -> {bd.queue}: exchange or queue not declared")
            queue = b.queues[bd.queue]
            if not any(x.key == bd.key and x.queue is queue for x in b.exchanges[bd.exchange].bindings):
                b.bind(bd.exchange, bd.key, queue)

    def _websocket_listener(self, w: Any) -> Listener:
        """AMQP over WebSocket (server/websocket.py); wss with a certificate."""
        tls = w.cert_file is not None
        ctx = server_context(str(w.cert_file), str(w.key_file), None, "[websocket]") if tls else None
        anon = w.allow_anonymous if w.allow_anonymous is not None else self.settings.allow_anonymous
        return Listener("wss" if tls else "ws", w.host, w.port, self._sasl_policy(w.host, anon, tls=tls),
                        w.client_id_policy, ctx, websocket=True)

    def _protocol_factory(self, lst: Listener) -> Callable[[], asyncio.Protocol]:
        """What an accepted socket talks to: AMQP (over WebSocket on a WebSocket
        listener), after a TLS handshake on TLS listeners."""
        def amqp() -> asyncio.Protocol:
            return WebSocketAmqp(self, lst) if lst.websocket else AmqpProtocol(self, lst)
        if lst.ssl_context is None:
            # In a cluster: plain client connections may be handed to the node that
            # owns their first link's address (server/ports.py ClusterPort).
            return amqp if self.cluster is None or lst.websocket else self.cluster.protocol_factory(lst, amqp)
        return tls_protocol_factory(self, lst, amqp)

    def _sasl_policy(self, host: str, allow_anon: bool | None, tls: bool = False,
                     external: bool = False) -> SaslPolicy:
        anonymous = anonymous_allowed(allow_anon, host)
        plain = plain_allowed(self.settings.allow_insecure_plain, host, tls)
        # EXTERNAL only where the TLS layer verified a client certificate (RFC 4422 App. A).
        mechs = ("EXTERNAL",) * external + tuple(m for m in ALL_MECHANISMS
                                                 if (m != "ANONYMOUS" or anonymous) and (m != "PLAIN" or plain))
        return SaslPolicy(mechanisms=mechs, allow_no_sasl=anonymous,
                          handshake_timeout=self.settings.limits.sasl_timeout)

    async def start(self) -> None:
        self.prepare()
        await self.listen()

    def prepare(self) -> None:
        """The store recovered and everything declared; nothing listens yet (a
        `--workers` node moves misplaced subscriptions in between: cluster/node.py)."""
        snapshot = self.store.open(self.loop)
        self.durability.recover(snapshot, subscription_filter)
        self.durability.install()
        if self.cluster is not None:
            self.cluster.recovered()   # subscriptions the map moved away: moved, or the start refused
        self._declare_configured()
        log.log(*self.broker.declare_dead_letters())   # the DLQ exists before anything dies
        self.alarm_watch.start()        # first readings before any producer attaches

    async def listen(self) -> None:
        """The management server, then the client listeners."""
        s = self.settings
        await self.operations.start()   # before the AMQP listeners: its port is logged first
        self.listeners.append(Listener("amqp", s.host, s.port, self._sasl_policy(s.host, s.allow_anonymous),
                                       s.client_id_policy))
        if s.tls is not None:
            t = s.tls
            ctx = server_context(str(t.cert_file), str(t.key_file),
                                 str(t.client_ca_file) if t.client_ca_file else None)
            # Unset on [tls]: the top-level allow_anonymous applies (an explicit
            # `allow_anonymous = false` must not leave the TLS listener open).
            tls_anon = t.allow_anonymous if t.allow_anonymous is not None else s.allow_anonymous
            lst = Listener("amqps", t.host, t.port,
                           self._sasl_policy(t.host, tls_anon, tls=True, external=t.client_ca_file is not None),
                           t.client_id_policy, ctx)
            if t.client_ca_file is not None:   # EXTERNAL: the verified certificate names the user
                lst.cert_identity = CertIdentities.from_settings(t.cert_user, t.cert_users, t.cert_cn_users)
            self.listeners.append(lst)
        if s.websocket is not None:
            self.listeners.append(self._websocket_listener(s.websocket))
        for lst in self.listeners:
            lst.server = await self.loop.create_server(self._protocol_factory(lst), lst.host, lst.port,
                                                       reuse_address=True, reuse_port=self.reuse_port or None)
            sock = lst.server.sockets[0].getsockname()
            lst.port = sock[1]
            log.info("%s listening on %s:%d (SASL %s)", lst.name, lst.host, lst.port,
                     ", ".join(lst.sasl_policy.mechanisms) or "none")
        self._schedule_wakeup()

    # ------------------------------------------------------------------ admission

    def admit(self, handler: Any) -> tuple[str, str, bool] | None:
        """None to accept, else (condition, description, is-client-id-clash)."""
        if self.stopping:
            return ("amqp:connection:forced", "broker is shutting down", False)
        if self.connection_count >= self.settings.limits.max_connections:
            return ("amqp:resource-limit-exceeded", "too many connections", False)
        policy = handler.protocol.listener.client_id_policy
        sole = "sole-connection-for-container" in symbols(handler.conn.remote_desired_capabilities)
        if (policy is ClientIdPolicy.RESTRICTED and sole
                and self.handlers_by_container.get(handler.container_id)):
            return ("amqp:invalid-field",
                    f"container-id '{handler.container_id}' is already connected", True)
        return None

    def handshake_refused(self, address: str, why: str) -> None:
        """A socket closed at accept (core/handshakes.py).  A flood must not flood the
        log too: one line, then at most one every 10 s with the count since."""
        now = time.monotonic()
        if now - self._refusals_logged_at < 10.0:
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more since the last line)" if self._refusals_unlogged else ""
        log.warning("connection from %s closed at accept: %s%s", address, why, more)
        self._refusals_logged_at = now
        self._refusals_unlogged = 0

    def authentication_failed(self, address: str, user: str | None = None) -> None:
        failures = self.auth_throttle.failed(address, user)
        if failures == self.auth_throttle.free_failures + 1:
            log.warning("%d failed authentications from %s: its next attempts wait (up to %.0f s)",
                        failures, address, self.auth_throttle.max_delay)

    def register(self, handler: Any) -> None:
        self.connection_count += 1
        self.handlers_by_container.setdefault(handler.container_id, []).append(handler)

    def unregister(self, handler: Any) -> None:
        self.connection_count -= 1
        lst = self.handlers_by_container.get(handler.container_id, [])
        if handler in lst:
            lst.remove(handler)
        if not lst:
            self.handlers_by_container.pop(handler.container_id, None)
        for key, (h, _) in list(self.live_links.items()):
            if h is handler:
                del self.live_links[key]

    # ------------------------------------------------------------------ links

    def steal_link(self, handler: Any, link: Link) -> None:
        """AMQP 1.0 §2.6.1: a link is identified by (container-id, name, role); the
        same link attached again elsewhere takes it over (`amqp:link:stolen`) — but
        only by the same user: anyone can claim a container-id, so an attach by
        another user (or an anonymous one) is refused and the holder keeps its link."""
        key = (handler.container_id, link.name, link.is_sender)
        previous = self.live_links.get(key)
        if previous is not None and previous[0].protocol.user != handler.protocol.user:
            raise AttachRefused(UNAUTHORIZED, f"link '{link.name}' of container '{handler.container_id}' "
                                              f"is attached by another user")
        self.live_links[key] = (handler, link)
        if previous is None:
            return
        old_handler, old_link = previous
        if old_handler is handler and old_link.session == link.session:
            return
        old_handler.stolen(old_link)
        log.info("link '%s' of container %s stolen by a new attach", link.name, handler.container_id)

    def forget_link(self, handler: Any, link: Link) -> None:
        try:
            name = link.name
        except UnicodeDecodeError:
            return   # refused for its name (invalid UTF-8): it was never registered
        key = (handler.container_id, name, link.is_sender)
        current = self.live_links.get(key)
        if current is not None and current[0] is handler and current[1] == link:
            del self.live_links[key]

    async def reload_config(self, who: str, allow_open: bool = False) -> dict:
        """Live reload (server/reload.py); ValueError (nothing changed) for a bad file."""
        return await self.reloader.reload(who, allow_open)

    # ------------------------------------------------------------------ output

    def flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.guard is not None and not self.guard():
            return   # HA: nothing goes out while this broker may not accept (its connections are closing)
        if TRACE is not None:
            TRACE.mark("flush", 0, len(self.dirty))
        while self.dirty:
            batch, self.dirty = self.dirty, []
            for proto in batch:
                proto.flush()
        if TRACE is not None:
            TRACE.mark("flush", 0, -1)
        self._schedule_wakeup()

    def _schedule_wakeup(self) -> None:
        """Delayed deliveries: wake when the earliest scheduled message is due."""
        due = self.broker.next_wakeup()
        if due is None or (self._wakeup is not None and self._wakeup_at == due):
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = due
        self._wakeup = self.loop.call_later(max(0.0, due - time.time()), self._on_wakeup)

    def _on_wakeup(self) -> None:
        if TRACE is not None:
            TRACE.mark("wakeup", 0)
        self._wakeup = None
        self._wakeup_at = None
        self.broker.tick()
        self.flush_soon()

    # ------------------------------------------------------------------ HA fencing (ha/node.py)

    def close_listeners(self) -> None:
        """New connections are refused (the sockets stop listening)."""
        for lst in self.listeners:
            if lst.server is not None:
                lst.server.close()

    async def reopen_listeners(self) -> None:
        """Listen again on the same addresses."""
        for lst in self.listeners:
            if lst.server is not None and lst.server.is_serving():
                continue
            lst.server = await self.loop.create_server(self._protocol_factory(lst), lst.host, lst.port,
                                                       reuse_address=True)
            log.info("%s listening on %s:%d again", lst.name, lst.host, lst.port)

    def close_connections(self, condition: str, description: str) -> None:
        """Close every connection with `condition`, writing the close now; nothing more
        is read from them (the socket closes once the output is written)."""
        for proto in list(self.protocols):
            h = proto.handler
            if h is None or not h.opened or h.ended:
                proto.abort()
                continue
            h.conn.condition = Condition(condition, description)
            h.conn.close()
            proto.flush()
            proto.stop_reading()

    def abort_connections(self, protocols: list | None = None) -> None:
        """Drop these connections' sockets (default: all) without a word."""
        for proto in list(self.protocols) if protocols is None else protocols:
            proto.abort()

    # ------------------------------------------------------------------ shutdown

    async def stop(self, grace: float = 5.0) -> None:
        """Close every connection with amqp:connection:forced, let in-flight work
        finish, then stop."""
        self.stopping = True
        self.resources.close()
        self.alarm_watch.close()
        await self.operations.stop()
        for lst in self.listeners:
            if lst.server is not None:
                lst.server.close()
        for proto in list(self.protocols):
            h = proto.handler
            if h is None:  # still in SASL: nothing to close politely
                proto.abort()
            elif h.opened and not h.ended:
                h.conn.condition = Condition("amqp:connection:forced", "broker shutting down")
                h.conn.close()
                proto.mark_dirty()
        self._flush()
        deadline = self.loop.time() + grace
        while self.protocols and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for proto in list(self.protocols):
            proto.abort()
        for lst in self.listeners:
            if lst.server is not None:
                await lst.server.wait_closed()
        self.store.close()
        log.info("broker stopped")


def install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: Callable[[], None],
                            reload: Callable[[], None] | None = None) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)
