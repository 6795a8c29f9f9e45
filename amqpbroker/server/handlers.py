"""Proton events → broker calls, and broker answers → proton.  One per connection.

This is the thin translation layer: every decision about addresses, routing and
subscriptions is made in amqpbroker.core; here we read performatives into plain
terms, ask the core, and write its answer back as frames.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from proton import Condition, Delivery, Endpoint, Event, Link, symbol

from .. import PRODUCT, __version__
from ..core.addresses import AddressKind, AddressNotFound
from ..core.broker import QueueLimit
from ..core.queues import LifetimePolicy
from ..core.settlement import LinkEnding
from ..core.wire import close_frame
from ..core.subscriptions import RESOURCE_LIMIT, DetachAction
from dataclasses import replace

from ..core.addresses import Resolution
from .attach import ConsumerAttacher, temp_name
from .ports import AttachHere
from .refusal import AttachRefused, check_access, detach_with_condition, refuse_link
from .links import EndedDeliveries, LinkConsumer, link_key, session_key
from .inbound import receive, route
from .producers import Producer
from cproton import lib
from .coordinator import Coordinator, stage_ack
from .peer_fields import attach_problem, condition_text, link_name, open_problem
from .terminus import read_target, write_target
from .sequence import CONTROL_ADDRESSES, RangeReader, attach_control
from ..core.terms import TargetTerms

if TYPE_CHECKING:
    from .engine import AmqpProtocol

log = logging.getLogger("amqpbroker.connection")

OFFERED_CAPABILITIES = ["SHARED-SUBS", "ANONYMOUS-RELAY", "DELAYED_DELIVERY",
                        "sole-connection-for-container"]
SOLE_CONNECTION = "sole-connection-for-container"


# Event type → handler method (names, not bound methods: a table of bound methods
# would make every handler a reference cycle of its own).
_EVENT_METHODS = {
    Event.CONNECTION_REMOTE_OPEN.number: "on_connection_remote_open",
    Event.CONNECTION_REMOTE_CLOSE.number: "on_connection_remote_close",
    Event.SESSION_REMOTE_OPEN.number: "on_session_remote_open",
    Event.SESSION_REMOTE_CLOSE.number: "on_session_remote_close",
    Event.LINK_REMOTE_OPEN.number: "on_link_remote_open",
    Event.LINK_REMOTE_DETACH.number: "on_link_remote_detach",
    Event.LINK_REMOTE_CLOSE.number: "on_link_remote_close",
    Event.TRANSPORT_ERROR.number: "on_transport_error",
    Event.TRANSPORT_TAIL_CLOSED.number: "on_transport_tail_closed",
}


class ConnectionHandler:
    def __init__(self, protocol: "AmqpProtocol"):
        self.protocol = protocol
        self.server = protocol.server
        self.broker = self.server.broker
        self.conn = protocol.connection
        self.container_id: str | None = None
        self.connection_key: str | None = None   # publisher identity for no-local
        self.opened = False
        self.ended = False
        self.sessions = 0
        self.links = 0
        self.endpoints: dict[int, Any] = {}       # id(link impl) → LinkConsumer / Producer
        self.consumers: list[LinkConsumer] = []
        self.ended_deliveries = EndedDeliveries(protocol.loop)
        # Producers no longer endpoints whose settlements still wait on a store commit
        # (raw pn_link_t* → Producer): see _release and on_session_remote_close.
        self.settling: dict[Any, Producer] = {}
        # Raw pn_session_t* → the order its producers' transfers are answered in
        # (core/ordering.py): one per session, dropped when the session ends.
        self.settlement_orders: dict[Any, Any] = {}
        self.free_after_output: list[Link] = []   # links to free once their dispositions are written
        self.attacher = ConsumerAttacher(self)
    def dispatch(self, ev: Event) -> None:
        name = _EVENT_METHODS.get(ev.type.number)
        if name is not None:
            getattr(self, name)(ev)

    def release(self) -> None:
        """The socket is gone and the connection has ended: drop the references that
        make the handler, its protocol and proton's transport a cycle, so they are
        freed at once (by reference counting) instead of waiting for a collection
        that an idle broker never runs (cli.tune_gc)."""
        self.attacher = None
        self.consumers = []
        self.endpoints = {}
        self.settling = {}
        self.settlement_orders = {}
        self.free_after_output = []
        self.ended_deliveries.clear()

    # ------------------------------------------------------------------ connection

    def on_connection_remote_open(self, ev: Event) -> None:
        conn = self.conn
        problem = open_problem(conn)
        if problem is not None:
            self.container_id = f"undecodable-{id(self)}"
            conn.open()
            conn.condition = Condition(*problem)
            conn.close()
            log.warning("connection from %s refused: %s: %s", self.protocol.peer, *problem)
            self.ended = True
            return
        self.container_id = conn.remote_container or f"anonymous-{id(self)}"
        self.connection_key = self.container_id
        conn.container = self.server.settings.container_id
        conn.offered_capabilities = OFFERED_CAPABILITIES
        conn.properties = {symbol("product"): PRODUCT, symbol("version"): __version__}
        refusal = self.server.admit(self)
        cluster = self.server.cluster
        if refusal is None and cluster is not None and cluster.claims(self):
            # Another node grants this client-id (sole-connection-for-container across
            # the cluster): answered once it has; the frames after the open wait.
            self.protocol.pause_events()
            cluster.claim(self, self._claimed)
            return
        self._answer_open(refusal)

    def _claimed(self, refusal: tuple | None) -> None:
        if self.ended or self.protocol.closed:
            return
        self._answer_open(refusal)
        self.protocol.resume_events()

    def _answer_open(self, refusal: tuple | None) -> None:
        conn = self.conn
        if refusal is not None:
            # (condition, description, clash[, info]): info of a cluster's redirect
            condition, description, clash, *extra = refusal
            if clash:
                # The shape Qpid JMS turns into InvalidClientIDException.
                conn.properties = {symbol("amqp:connection-establishment-failed"): True}
                info = {symbol("invalid-field"): symbol("container-id")}
            else:
                info = extra[0] if extra else None
            conn.open()
            conn.condition = Condition(condition, description, info)
            conn.close()
            log.warning("connection from %s (container %s) refused: %s",
                        self.protocol.peer, self.container_id, description)
            self.ended = True
            return
        conn.open()
        self.opened = True
        self.protocol.opened()
        self.server.register(self)
        log.info("connection open: %s container=%s user=%s", self.protocol.peer,
                 self.container_id, self.protocol.user)

    def on_connection_remote_close(self, ev: Event) -> None:
        cond = self.conn.remote_condition
        self.conn.close()
        self._end(f"closed by peer{condition_text(cond)}", LinkEnding.CONNECTION_CLOSED)

    def on_transport_error(self, ev: Event) -> None:
        cond = ev.transport.condition
        self._end(f"transport error: {cond.name}: {cond.description}" if cond else "transport error",
                  self._lost())

    def on_transport_tail_closed(self, ev: Event) -> None:
        """The engine stopped reading.  After the peer's close, an error, or the socket
        going, that is expected; otherwise proton met input it could not frame and
        dropped it without a word: close with the error instead of idling out."""
        if self.ended or self.protocol.closed or self.conn.state & Endpoint.REMOTE_CLOSED:
            return
        self.protocol_violation("amqp:connection:framing-error", "a frame the engine could not read")

    def protocol_violation(self, condition: str, description: str) -> None:
        """Close at once with the violation (core/wire.py, or the engine's framing)."""
        conn = self.conn
        if not conn.state & Endpoint.LOCAL_ACTIVE and not conn.state & Endpoint.LOCAL_CLOSED:
            conn.open()
        conn.condition = Condition(condition, description)
        conn.close()
        peer_opened = conn.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED)
        self.protocol.stop_reading(b"" if peer_opened else close_frame(condition, description))
        log.warning("connection %s (container %s) closed: protocol violation: %s: %s",
                    self.protocol.peer, self.container_id, condition, description)
        self._end(f"protocol violation: {condition}", LinkEnding.CONNECTION_LOST)

    def socket_closed(self) -> None:
        self._end("socket closed", self._lost())

    def _lost(self) -> LinkEnding:
        """The transport ended without the peer's close: lost (socket error, idle
        timeout, a killed client), unless the broker had closed the connection."""
        if self.conn.state & Endpoint.LOCAL_CLOSED:
            return LinkEnding.BROKER_ENDED
        return LinkEnding.CONNECTION_LOST

    def internal_error(self) -> None:
        """A handler raised: close the connection rather than leave it half-done."""
        if not self.ended:
            self.conn.condition = Condition("amqp:internal-error", "internal broker error")
            self.conn.close()

    def _end(self, why: str, ending: LinkEnding) -> None:
        if self.ended:
            return
        self.ended = True
        # A connection that drops with open transactions rolls them back (§4.4.1).
        txns = self.server.transactions
        for txn in txns.owned_by(self):
            txns.take(txn.txn_id)
            txns.rollback(txn)
        for endpoint in list(self.endpoints.values()):
            self._release(endpoint, closed=False, ending=ending)
        self.endpoints.clear()
        for producer in self.settling.values():
            producer.abandon()   # the connection's deliveries go with it
        self.settling.clear()
        self.free_after_output.clear()
        self.ended_deliveries.clear()
        for sub in self.server.subscriptions.owned_by(self):
            self.server.subscriptions.delete(sub)
        for queue in list(self.broker.queues_owned_by(self)):
            self.broker.delete_queue(queue.name)
        if self.server.cluster is not None:
            self.server.cluster.connection_ended(self, ending)
        if self.opened:
            self.server.unregister(self)
            log.info("connection closed: %s container=%s (%s)", self.protocol.peer, self.container_id, why)

    def writable_again(self) -> None:
        for consumer in self.consumers:
            consumer.queue.dispatch()

    # ------------------------------------------------------------------ sessions

    def on_session_remote_open(self, ev: Event) -> None:
        session = ev.session
        if self.sessions >= self.server.settings.limits.max_sessions_per_connection:
            session.open()
            session.condition = Condition(RESOURCE_LIMIT, "too many sessions on this connection")
            session.close()
            log.warning("connection %s: session refused (limit %d)", self.protocol.peer, self.sessions)
            return
        self.sessions += 1
        session.open()

    def on_session_remote_close(self, ev: Event) -> None:
        """AMQP 1.0 §2.5.2: the end detaches every link of the session; nothing can be
        settled on it afterwards, so producers' pending answers are dropped too."""
        session = ev.session
        link = self.conn.link_head(0)
        while link:
            if link.session == session:
                self.server.forget_link(self, link)
                key = link_key(link)
                endpoint = self.endpoints.pop(key, None)
                if endpoint is not None:
                    self.links -= 1
                    self._release(endpoint, closed=False, ending=LinkEnding.SESSION_ENDED)
                # Every producer of this session with settlements still waiting on the
                # store, including one whose link was detached earlier (it left
                # `endpoints` then): session.free() below frees its link and the
                # link's deliveries, which the commit callback would otherwise update
                # and settle afterwards (use-after-free: detach + end before a
                # durable transfer's commit crashed the broker).
                producer = self.settling.pop(key, None)
                if producer is not None:
                    producer.abandon()
                elif isinstance(endpoint, Producer):
                    endpoint.abandon()
            link = link.next(0)
        if self.free_after_output:   # freed below, with the session: not twice
            self.free_after_output = [k for k in self.free_after_output
                                      if lib.pn_link_session(k._impl) != session._impl]
        self.ended_deliveries.session_ended(session._impl)
        self.settlement_orders.pop(session._impl, None)
        for sub in self.server.subscriptions.owned_by(session_key(session)):
            self.server.subscriptions.delete(sub)
        for queue in list(self.broker.queues_owned_by(session_key(session))):
            self.broker.delete_queue(queue.name)
        if self.server.cluster is not None:
            self.server.cluster.session_ended(self, session)   # its sessions on other nodes end too
        if session.state & session.LOCAL_ACTIVE:
            self.sessions -= 1
            session.close()
        # Freed with its links: a connection that opens a session per unit of work
        # (JmsTemplate without a session cache) must not grow.
        session.free()

    # ------------------------------------------------------------------ links

    def on_link_remote_open(self, ev: Event) -> None:
        link = ev.link
        problem = attach_problem(link)
        if problem is not None:
            self.refuse(link, *problem)
            return
        if self.links >= self.server.settings.limits.max_links_per_connection:
            self.refuse(link, RESOURCE_LIMIT, "too many links on this connection")
            return
        link.max_message_size = self.server.settings.limits.max_message_size
        try:
            check_access(self.server.access, self.protocol.user, link, self.container_id)
            cluster = self.server.cluster
            if cluster is not None:
                # Another node owns the address: the link is forwarded there
                # (amqpbroker/cluster, through server/ports.py ClusterPort).
                forwarded = cluster.attach(self, link)
                if isinstance(forwarded, AttachHere):
                    self.attach_here(link, forwarded)   # a partitioned destination's member here
                    return
                if forwarded is not None:
                    self.links += 1
                    self.endpoints[link_key(link)] = forwarded
                    return
        except AttachRefused as refused:
            self.server.forget_link(self, link)
            self.refuse(link, refused.condition, refused.description)
            return
        self.attach_here(link)

    def attach_here(self, link: Link, here: AttachHere | None = None) -> None:
        """The attach of a link this broker owns (also the cluster's, once the other
        nodes have answered about a subscription's name: cluster/guard.py)."""
        try:
            # Steal first (AMQP 1.0 §2.6.1), only from the same user: the previous
            # holder's consumer must be gone before the subscription table looks at
            # consumer counts.
            self.server.steal_link(self, link)
            if link.is_sender:
                endpoint = self.attacher.attach(link)
            else:
                endpoint = self._attach_producer(link, here)
        except AttachRefused as refused:
            self.server.forget_link(self, link)
            self.refuse(link, refused.condition, refused.description)
            return
        self.links += 1
        self.endpoints[link_key(link)] = endpoint

    def refuse(self, link: Link, condition: str, description: str) -> None:
        """Refuse an attach (server/refusal.py refuse_link), counted and logged."""
        refuse_link(link, condition, description)
        self.server.metrics_refused[condition] = self.server.metrics_refused.get(condition, 0) + 1
        log.warning("connection %s: attach of link '%s' refused: %s: %s", self.protocol.peer,
                    link_name(link), condition, description)

    def _attach_producer(self, link: Link, here: AttachHere | None = None) -> Producer:
        target = read_target(link.remote_target)
        if here is not None:   # the client's terms answered; its messages go to `here`
            check_access(self.server.access, self.protocol.user, link, self.container_id, here.address)
        if target.coordinator:
            return self._attach_coordinator(link)
        if target.address in CONTROL_ADDRESSES:   # $amqpbroker.queue-info / $amqpbroker.ack
            return attach_control(self, link, target)
        resolution = None
        temp_node = None
        if target.dynamic:
            # Qpid JMS createTemporaryQueue/Topic: a dynamic target names a new node
            # that lives until this link (or the connection) closes.
            if target.has("temporary-topic") or target.has("topic"):
                name = temp_name("topic", self.server.cluster)
                self.broker.declare_temporary(name, self, topic=True)
                temp_node = ("exchange", name)
                resolution = Resolution(AddressKind.EXCHANGE, name, "")
            else:
                name = temp_name("queue", self.server.cluster)
                self.broker.declare_temporary(name, self)
                temp_node = ("queue", name)
                resolution = Resolution(AddressKind.QUEUE, name)
            target = replace(target, address=name)
        elif target.address:
            try:
                address = target.address if here is None else here.address
                resolution = self.broker.resolve(address, topic=target.has("topic"))
            except AddressNotFound as exc:
                raise AttachRefused("amqp:not-found", exc.why) from None
            if resolution.kind is AddressKind.NEW_QUEUE:
                try:
                    self.broker.auto_create(resolution.name, self.protocol.user)
                except QueueLimit as exc:
                    raise AttachRefused(RESOURCE_LIMIT, str(exc)) from None
                resolution = resolution.__class__(AddressKind.QUEUE, resolution.name)
        link.source.copy(link.remote_source)
        write_target(link.target, target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()
        limits = self.server.settings.limits
        producer = Producer(self, link, resolution, limits.link_credit, limits.max_message_size)
        producer.temp_node = temp_node
        producer.partition = None if here is None else here.partition
        producer.served_as = None if here is None else here.address   # what a reload checks again too
        return producer

    def _attach_coordinator(self, link: Link) -> Coordinator:
        """AMQP 1.0 §4.2: the coordinator target; we offer local transactions."""
        link.source.copy(link.remote_source)
        write_target(link.target, TargetTerms(coordinator=True,
                                              capabilities=frozenset({"amqp:local-transactions"})))
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()
        return Coordinator(self, link, 100)

    def on_link_remote_detach(self, ev: Event) -> None:
        self._link_detached(ev.link, closed=False)

    def on_link_remote_close(self, ev: Event) -> None:
        self._link_detached(ev.link, closed=True)

    def _link_detached(self, link: Link, *, closed: bool) -> None:
        endpoint = self.endpoints.pop(link_key(link), None)
        if getattr(endpoint, "forwarded", False):
            self.links -= 1
            endpoint.detached(closed)   # answered once the owning node has answered
            return
        self.server.forget_link(self, link)
        answer: Condition | None = None
        if endpoint is not None:
            self.links -= 1
            answer = self._release(endpoint, closed=closed, ending=LinkEnding.DETACHED)
        if link.state & Link.LOCAL_CLOSED:
            return
        if answer is not None:
            link.condition = answer
        sub = getattr(endpoint, "subscription", None)
        if closed and sub is not None and sub.durable and self.server.store.persistent:
            # Unsubscribe: reply once the deletion is on disk.
            self.server.store.after_commit(lambda err: self._answer_detach(link, closed, endpoint))
            return
        self._answer_detach(link, closed, endpoint)

    def _answer_detach(self, link: Link, closed: bool, endpoint: Any) -> None:
        if self.ended or link.session.state & Endpoint.LOCAL_CLOSED:
            return   # the connection or the session ended meanwhile (and took the link)
        if closed:
            link.close()
        else:
            detach_with_condition(link)
        self._free(link, endpoint)
        self.protocol.mark_dirty()

    def _free(self, link: Link, endpoint: Any) -> None:
        """Free a link both ends have detached, so that a long-lived connection whose
        application opens and closes consumers (JmsTemplate) does not grow.  Not while
        its deliveries may still be touched: settlements waiting for a store commit
        (freed once they drain, settled_after_release; or abandoned if the session
        ends first), late outcomes (EndedDeliveries frees it after)."""
        if isinstance(endpoint, Producer) and endpoint.waiting:
            # pn_link_free settles and frees the link's deliveries, and the pending
            # commit callback would then update them: wait for it.
            endpoint.free_when_settled = True
            return
        if endpoint is None:
            return   # ended by the broker earlier: it may still hold deliveries
        if self.ended_deliveries.free_when_done(link._impl):
            link.free()

    def refuse_after(self, link: Link, condition: str, description: str) -> None:
        """Refuse a link whose attach reply was held back (a failed durable commit)."""
        endpoint = self.endpoints.pop(link_key(link), None)
        if endpoint is not None:
            self.links -= 1
            self._release(endpoint, closed=False, ending=LinkEnding.BROKER_ENDED)
        self.refuse(link, condition, description)
        self.protocol.mark_dirty()

    def link_ended(self, link: Link) -> None:
        """We closed a link ourselves (e.g. message too large)."""
        endpoint = self.endpoints.pop(link_key(link), None)
        if endpoint is not None:
            self.links -= 1
            self._release(endpoint, closed=False, ending=LinkEnding.BROKER_ENDED)

    def stolen(self, link: Link) -> None:
        """AMQP 1.0 §2.6.2: the same link attached elsewhere takes it over."""
        endpoint = self.endpoints.pop(link_key(link), None)
        if endpoint is not None:
            self.links -= 1
            self._release(endpoint, closed=False, ending=LinkEnding.BROKER_ENDED)
        link.condition = Condition("amqp:link:stolen", "link attached again by another session")
        detach_with_condition(link)
        self.protocol.mark_dirty()

    def release_endpoint(self, endpoint: Any, *, closed: bool, ending: LinkEnding) -> Condition | None:
        """An endpoint that another one holds (not in `endpoints`: a partitioned
        destination's own member, cluster/fanin.py) ends as if its link had: what
        the detach answer must carry, if anything."""
        return self._release(endpoint, closed=closed, ending=ending)

    def _release(self, endpoint: Any, *, closed: bool, ending: LinkEnding) -> Condition | None:
        if getattr(endpoint, "forwarded", False):
            endpoint.released(ending)
            return None
        temp = getattr(endpoint, "temp_node", None)
        if temp is not None:
            endpoint.temp_node = None
            if isinstance(endpoint, LinkConsumer):
                endpoint.close(ending)
            kind, name = temp
            if kind == "queue":
                self.broker.delete_queue(name)
            else:
                self.broker.delete_exchange(name)
        if isinstance(endpoint, LinkConsumer):
            endpoint.close(ending)
            if endpoint in self.consumers:
                self.consumers.remove(endpoint)
            return self._consumer_gone(endpoint, closed)
        if endpoint.__class__ is RangeReader:
            endpoint.close()
        if isinstance(endpoint, Producer):
            endpoint.stop_flow()
            endpoint.released = True
            if endpoint.waiting:
                # Its accepted-after-commit settlements still hold pn_delivery_t*s: they
                # are sent once the commit comes (a durable message is accepted only
                # once stored), unless the session ends first; until then the link
                # and its session must not be freed without abandoning them.
                self.settling[endpoint.impl] = endpoint
        return None

    def settled_after_release(self, producer: Producer) -> None:
        """A released producer's last waiting settlement was made: its link may be
        freed (if _free deferred it) once the transport has written those
        dispositions; freed now, proton would drop them unsent."""
        self.settling.pop(producer.impl, None)
        if producer.free_when_settled:
            producer.free_when_settled = False
            if not self.ended:
                self.free_after_output.append(producer.link)

    def output_written(self) -> None:
        """The transport's output is all on the socket (AmqpProtocol.flush)."""
        links, self.free_after_output = self.free_after_output, []
        if not self.ended:
            for link in links:
                link.free()

    def _consumer_gone(self, consumer: LinkConsumer, closed: bool) -> Condition | None:
        queue = consumer.queue
        sub = consumer.subscription
        if sub is not None:
            action = self.server.subscriptions.detach(sub, consumer.link.name, closed=closed)
            if action is DetachAction.REFUSE_LOCKED:
                return Condition("amqp:resource-locked",
                                 f"There are active consumers on the shared subscription "
                                 f"'{sub.key.name if sub.key else sub.queue_name}'")
            return None
        if (queue.lifetime is LifetimePolicy.DELETE_ON_NO_LINKS and not queue.consumers
                and not queue.deleted):
            self.broker.delete_queue(queue.name)
        return None

    # ------------------------------------------------------------------ flow and deliveries

    # The two per-message events arrive as raw pointers (see engine._process).

    def on_link_flow_raw(self, link: Any) -> None:
        endpoint = self.endpoints.get(link)
        if endpoint is not None and endpoint.__class__ is LinkConsumer:
            endpoint.on_flow()
        elif endpoint is not None and endpoint.__class__ is RangeReader:
            endpoint.on_flow()
        elif isinstance(endpoint, Producer) or getattr(endpoint, "forwarded", False):
            # a producer's flow carries the peer's delivery-count (producers.py); a forwarded
            # link's goes to the node that holds its queue (cluster/)
            endpoint.on_flow()

    def on_delivery_raw(self, dlv: Any) -> None:
        link = lib.pn_delivery_link(dlv)
        endpoint = self.endpoints.get(link)
        if endpoint is None:   # its link has ended: a late disposition
            producer = self.settling.get(link) if self.settling else None
            if producer is not None and producer.holds(dlv):
                return   # settled by drain_settlements when its commit comes, not before
            cluster = self.server.cluster
            if cluster is not None and cluster.late_delivery(self, link, dlv):
                return   # a forwarded link's: passed on to the node that owns it
            self.ended_deliveries.on_delivery(dlv)
        else:
            endpoint.on_delivery(dlv)

    # Transfers in (server/inbound.py): module functions taking the handler as `self`.
    receive = receive
    route = route

    def transactional_ack(self, consumer: LinkConsumer, dlv: Delivery, entry: Any) -> None:
        stage_ack(self, consumer, dlv, entry)



