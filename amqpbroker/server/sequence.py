"""Log-style access to durable queues, for stream processors (docs/spark.md).

* `RangeReader`: a sending link attached with distribution-mode `copy` and the
  source filter `amqpbroker:sequence-range` [from, to).  It reads the *store*
  (`read_entries` / `read_message`), not the queue's ready list: messages that
  other consumers hold are still visible, and reading the same range again gives
  the same messages (unless they were acknowledged in between).  Each message is
  sent with the annotation `x-opt-sequence`; when the range is exhausted a drain
  completes (credit 0).
* `ControlLink`: a receiving link on `$amqpbroker.queue-info` (head/tail sequence
  of a queue, answered to the request's reply-to) or `$amqpbroker.ack`
  (a reader acknowledges everything below N: removed through `Queue.remove_below`,
  so the durability hooks delete the store entries).
* `dedup_publish`: duplicate detection by message-id on addresses matching a
  `[[duplicate_detection]]` rule (core/dedup.py); ids are stored with the message.

The rules are in core/sequence.py and core/dedup.py; this module only translates.
"""

from __future__ import annotations

import json
import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from cproton import ffi, lib
from proton import Condition, Link, ulong

from ..core.addresses import AddressKind, AddressNotFound, Resolution
from ..core.codec import encode
from ..core.dedup import DedupRule, DedupWindows, id_key, split_store_key, store_key
from ..core.message import PROPERTIES, MalformedMessage, Message
from ..core.queues import Queue
from ..core.sequence import (
    ACK_ADDRESS,
    CONTROL_ADDRESSES,
    QUEUE_INFO_ADDRESS,
    SEQUENCE_RANGE,
    AckRefused,
    RangeError,
    ReaderClaim,
    SeqRange,
    decide_ack,
    parse_range,
    with_sequence,
)
from ..core.terms import Filter, SourceTerms, TargetTerms
from .links import ACCEPTED, REJECTED, link_credit
from .producers import Producer
from .outbound import DELIVERY_COST, BoundedOutput
from .refusal import AttachRefused
from .terminus import write_source, write_target

if TYPE_CHECKING:
    from .ports import AttachContext, LinkOwner, ProducerOwner

log = logging.getLogger("amqpbroker.sequence")

_U64 = struct.Struct(">Q")
MAX_STORE_KEY = 511       # LMDB's key size limit
PUMP_BATCH = 512          # deliveries per loop turn and reader (fairness with other links)
READ_AHEAD = 256          # entries read from the store at a time


# ---------------------------------------------------------------------- per-server state


class SequenceService:
    """Reader claims and duplicate-detection windows of one broker, loaded from
    the store on first use (before anything of this run was recorded)."""

    def __init__(self, server: Any):
        self.server = server
        store = server.store
        self.dedup = DedupWindows(DedupRule(d.pattern, d.window)
                                  for d in server.settings.duplicate_detection)
        by_address: dict[str, list[tuple[bytes, int]]] = {}
        for k, v in store.read_records("dedup"):
            address, key = split_store_key(k)
            by_address.setdefault(address, []).append((key, _U64.unpack(v)[0]))
        kept = 0
        for address, pairs in by_address.items():
            window = self.dedup.window(address)
            gone = [key for key, _ in pairs] if window is None else window.restore(pairs)
            for key in gone:
                store.delete_record("dedup", store_key(address, key))
            kept += len(pairs) - len(gone)
        self.claims: dict[str, ReaderClaim] = {}
        for _, v in store.read_records("readers"):
            claim = ReaderClaim.from_json(json.loads(v))
            self.claims[claim.queue] = claim
        if kept or self.claims:
            log.info("sequence service: %d duplicate-detection id(s) on %d address(es), %d reader claim(s)",
                     kept, len(by_address), len(self.claims))

    def queue_info(self, name: str) -> dict:
        queue = self.server.broker.queues.get(name)
        if queue is None:
            return {"queue": name, "status-code": 404, "status-description": f"queue '{name}' not found"}
        info: dict[str, Any] = {"queue": name, "status-code": 200, "durable": queue.durable,
                                "depth": ulong(queue.depth)}
        store = self.server.store
        if queue.durable and queue.store_id is not None and store.persistent:
            durability = self.server.durability
            tail = durability.last_seq(queue)
            first = durability.read_entries(queue, 0, 1)
            info["head"] = ulong(first[0].seq if first else tail + 1)
            info["tail"] = ulong(tail)
        claim = self.claims.get(name)
        if claim is not None and claim.queue_id == queue.store_id:
            info["reader"] = claim.reader
            info["acked-below"] = ulong(claim.below)
        return info


def service(server: Any) -> SequenceService:
    svc = server.__dict__.get("_sequence_service")
    if svc is None:
        svc = server._sequence_service = SequenceService(server)
    return svc


# ---------------------------------------------------------------------- range reader


def range_filter(source: SourceTerms) -> Filter | None:
    for f in source.filters:
        if f.descriptor == SEQUENCE_RANGE or (f.descriptor is None and f.key == SEQUENCE_RANGE):
            return f
    return None


def attach_range_reader(attacher: "AttachContext", link: Link, source: SourceTerms,
                        flt: Filter) -> "RangeReader":
    handler = attacher.handler
    try:
        wanted = parse_range(flt.value)
    except RangeError as exc:
        raise AttachRefused("amqp:invalid-field", str(exc)) from None
    if source.distribution_mode != "copy":
        raise AttachRefused("amqp:invalid-field",
                            f"a {SEQUENCE_RANGE} filter needs distribution-mode copy (a non-acquiring read)")
    queue = handler.broker.queues.get(source.address or "")
    if queue is None:
        raise AttachRefused("amqp:not-found", f"queue '{source.address}' not found")
    store = handler.server.store
    if not queue.durable or queue.store_id is None or not store.persistent:
        raise AttachRefused("amqp:not-implemented",
                            f"queue '{queue.name}' is not stored: sequence-range reads need a durable "
                            f"queue and the persistent store")
    served = wanted.bound(handler.server.durability.last_seq(queue))
    reply = source.with_(filters=(Filter(flt.key, SEQUENCE_RANGE, served.as_filter_value()),))
    write_source(link.source, reply)
    link.target.copy(link.remote_target)
    link.snd_settle_mode = link.remote_snd_settle_mode
    link.rcv_settle_mode = link.remote_rcv_settle_mode
    link.open()
    reader = RangeReader(handler, link, queue, served)
    log.debug("connection %s: link '%s' reads queue %s by sequence [%d, %d)", handler.protocol.peer,
              link.name, queue.name, served.start, served.end)
    handler.server.loop.call_soon(reader.pump)
    return reader


class RangeReader(BoundedOutput):
    """A sending link serving stored entries from..to of one queue, in order.

    It hands the engine nothing while the socket is paused, or while the connection's
    output waits for a store commit (AmqpProtocol.hold_for_store, for a consumer on the
    same connection): what it sent then would only pile up in the engine, up to the
    link's credit (as for LinkConsumer.credit).  Nor while the engine holds as much of
    it unsent as it may (BoundedOutput: a peer whose session window stays closed)."""

    def __init__(self, handler: "LinkOwner", link: Link, queue: Queue, served: SeqRange):
        self.handler = handler
        self.link = link
        self.impl = link._impl
        self._session = lib.pn_link_session(self.impl)
        self._budget = 0
        self._waiting_output = False
        self.queue = queue
        self.queue_id = queue.store_id
        self.store = handler.server.store
        self.next_seq = served.start
        self.end = served.end
        self.presettled = link.snd_settle_mode == Link.SND_SETTLED
        self.exhausted = served.start >= served.end
        self.pending: deque = deque()
        self.closed = False
        self.sent = 0
        self._tag = 0
        self._scheduled = False
        self.temp_node = None
        self.subscription = None

    def on_flow(self) -> None:
        self.pump()

    def pump(self) -> None:
        """Send what the credit allows; complete a drain once the range is exhausted."""
        self._scheduled = False
        if self.closed or self.handler.ended:
            return
        impl = self.impl
        proto = self.handler.protocol
        budget = PUMP_BATCH
        while not self.exhausted and budget > 0:
            credit = link_credit(impl)
            if credit <= 0:
                break
            if proto.write_paused or proto.hold.held:
                self._again(0.005)
                break
            if self._budget <= 0 and not self.engine_room():
                break   # output_moved pumps again
            if not self.pending and not self._read_ahead(credit):
                self.exhausted = True
                break
            rec = self.pending.popleft()
            self.next_seq = rec.seq + 1
            raw = self.store.read_message(rec.msg_id)
            if raw is None:  # acknowledged since it was read ahead
                continue
            self._send(rec.seq, bytes(raw))
            budget -= 1
        else:
            if budget <= 0 and not self.exhausted:
                self._again(0)
        if self.exhausted and lib.pn_link_get_drain(impl) and link_credit(impl) > 0:
            lib.pn_link_drained(impl)   # AMQP 1.0 §2.6.7: nothing more to send
        proto.mark_dirty()

    def _read_ahead(self, credit: int) -> bool:
        if self.queue.deleted:
            return False
        records = self.handler.server.durability.read_entries(self.queue, self.next_seq - 1,
                                                              min(READ_AHEAD, max(credit, 16)))
        for rec in records:
            if rec.seq >= self.end:
                break
            self.pending.append(rec)
        return bool(self.pending)

    def _send(self, seq: int, raw: bytes) -> None:
        try:
            payload = with_sequence(raw, seq)
        except Exception:  # stored bytes were validated on arrival: should not happen
            log.warning("queue %s: message seq=%d could not be annotated; sent as stored", self.queue.name, seq)
            payload = raw
        impl = self.impl
        self._tag += 1
        tag = self._tag.to_bytes(8, "big")
        dlv = lib.pn_delivery(impl, (8, ffi.from_buffer(tag)))
        lib.pn_link_send(impl, ffi.from_buffer(payload), len(payload))
        lib.pn_link_advance(impl)
        self._budget -= len(payload) + DELIVERY_COST
        if self.presettled:
            lib.pn_delivery_settle(dlv)
        self.sent += 1

    def _again(self, delay: float) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        loop = self.handler.server.loop
        if delay:
            loop.call_later(delay, self._resume)
        else:
            loop.call_soon(self._resume)

    def _resume(self) -> None:
        self.pump()
        self.handler.server.flush_soon()

    def output_moved(self) -> None:
        self._waiting_output = False
        self._resume()

    def on_delivery(self, dlv: Any) -> None:
        """The peer settled a copy: outcomes of a non-acquiring read change nothing."""
        if lib.pn_delivery_updated(dlv) or lib.pn_delivery_settled(dlv):
            lib.pn_delivery_settle(dlv)

    def close(self) -> None:
        self.closed = True
        self.pending.clear()


# ---------------------------------------------------------------------- control addresses


def attach_control(handler: "ProducerOwner", link: Link, target: TargetTerms) -> "ControlLink":
    link.source.copy(link.remote_source)
    write_target(link.target, target)
    link.snd_settle_mode = link.remote_snd_settle_mode
    link.rcv_settle_mode = link.remote_rcv_settle_mode
    link.open()
    return ControlLink(handler, link, target.address)


class ControlLink(Producer):
    """A receiving link whose messages are queue-info requests or acknowledgements."""

    gated = False   # acknowledgements drain queues: never held by alarms or limits (server/flow.py)

    def __init__(self, handler: "ProducerOwner", link: Link, address: str):
        super().__init__(handler, link, None, 100, 1 << 20)
        self.address = address

    def on_delivery(self, dlv: Any) -> None:
        raw = self.whole_payload(dlv)
        if raw is None:
            return
        try:
            msg = Message(raw)
            props = msg.application_properties
            refusal = self._reply_refusal(msg)
            if refusal is not None:
                self._answer(dlv, REJECTED, "amqp:unauthorized-access", f"reply-to: {refusal}")
            elif self.address == QUEUE_INFO_ADDRESS:
                self._queue_info(dlv, msg, props)
            else:
                self._ack(dlv, msg, props)
        except MalformedMessage as exc:
            self._answer(dlv, REJECTED, "amqp:decode-error", str(exc))
        except (TypeError, ValueError) as exc:
            self._answer(dlv, REJECTED, "amqp:invalid-field", str(exc))
        self.handler.protocol.mark_dirty()

    def _answer(self, dlv: Any, state: int, condition: str | None = None, description: str = "",
                after_commit: bool = False) -> None:
        if lib.pn_delivery_settled(dlv):
            lib.pn_delivery_settle(dlv)
            return
        cond = Condition(condition, description) if condition else None
        store = self.handler.server.store
        if not after_commit or not store.persistent:
            self.settle_in_order(dlv, state, cond)
            return
        slot = self.settle_in_order(dlv, state, cond, ready=False)

        def done(error: BaseException | None) -> None:
            if self.handler.ended:
                return
            if error is not None:
                slot[1] = REJECTED
                slot[2] = Condition("amqp:resource-limit-exceeded", f"could not be stored: {error}")
            slot[3] = True
            self.drain_settlements()
            self.handler.protocol.mark_dirty()

        store.after_commit(done)

    def _queue_info(self, dlv: Any, msg: Message, props: dict) -> None:
        name = props.get("queue")
        if not isinstance(name, str) or not name:
            self._answer(dlv, REJECTED, "amqp:invalid-field", "queue-info needs application property 'queue'")
            return
        denied = self._denied("browse", name)
        if denied is not None:
            self._answer(dlv, REJECTED, "amqp:unauthorized-access", denied)
            return
        info = service(self.handler.server).queue_info(name)
        if not self._reply(msg, info):
            self._answer(dlv, REJECTED, "amqp:invalid-field", "queue-info needs a usable reply-to address")
            return
        self._answer(dlv, ACCEPTED)

    def _ack(self, dlv: Any, msg: Message, props: dict) -> None:
        h = self.handler
        name = props.get("queue")
        if not isinstance(name, str) or not name:
            self._answer(dlv, REJECTED, "amqp:invalid-field", "an acknowledgement needs application property 'queue'")
            return
        release = bool(props.get("release", False))
        below = props.get("below", 0 if release else None)
        if isinstance(below, bool) or not isinstance(below, int):
            self._answer(dlv, REJECTED, "amqp:invalid-field", "an acknowledgement needs integer property 'below'")
            return
        reader = props.get("reader") or h.container_id
        denied = self._denied("consume", name)     # acknowledging removes messages
        if denied is not None:
            self._answer(dlv, REJECTED, "amqp:unauthorized-access", denied)
            return
        queue = h.broker.queues.get(name)
        if queue is None:
            self._answer(dlv, REJECTED, "amqp:not-found", f"queue '{name}' not found")
            return
        store = h.server.store
        if not queue.durable or queue.store_id is None or not store.persistent:
            self._answer(dlv, REJECTED, "amqp:not-implemented", f"queue '{name}' is not stored")
            return
        svc = service(h.server)
        try:
            claim = decide_ack(svc.claims.get(name), name, queue.store_id, str(reader), int(below), release)
        except AckRefused as refused:
            self._answer(dlv, REJECTED, refused.condition, refused.description)
            return
        removed = 0 if release else queue.remove_below(int(below))
        if claim is None:
            svc.claims.pop(name, None)
            store.delete_record("readers", name.encode())
        else:
            svc.claims[name] = claim
            store.put_record("readers", name.encode(), json.dumps(claim.to_json()).encode())
        if removed:
            log.debug("queue %s: reader %s acknowledged below %d (%d removed)", name, reader, below, removed)
        self._reply(msg, {"queue": name, "status-code": 200, "reader": str(reader),
                          "acked-below": ulong(claim.below if claim else 0), "removed": ulong(removed)})
        self._answer(dlv, ACCEPTED, after_commit=True)

    def _denied(self, action: str, queue: str) -> str | None:
        """The ACL (security/guard.py), when one is configured: None when allowed."""
        access = getattr(self.handler.server, "access", None)
        if access is None or not access.enabled:
            return None
        return access.check(self.handler.protocol.user, action, queue)

    def _reply_refusal(self, request: Message) -> str | None:
        """The broker writes a reply where the request's reply-to says: only where the
        requester may send itself (the ACL), or to a temporary queue of its own
        connection — never a way into queues it may not write to."""
        access = getattr(self.handler.server, "access", None)
        if access is None or not access.enabled or not request.has_section(PROPERTIES):
            return None
        reply_to = request.prop("reply_to")
        if not reply_to:
            return None
        address = str(reply_to)
        broker = self.handler.broker
        try:
            node = broker.resolve(address).name
        except AddressNotFound:
            node = None   # no reply can go there anyway
        if node is not None and broker.temporaries.get(node) is self.handler:
            return None
        return access.check(self.handler.protocol.user, "send", address)

    def _reply(self, request: Message, info: dict) -> bool:
        """Send `info` (application properties and amqp-value body) to the request's
        reply-to; False when there is no reply-to or it names nothing."""
        if not request.has_section(PROPERTIES):
            return False
        reply_to = request.prop("reply_to")
        if not reply_to:
            return False
        correlation = request.prop("message_id")
        if correlation is None:
            correlation = request.prop("correlation_id")
        broker = self.handler.broker
        try:
            target = broker.resolve(str(reply_to))
        except AddressNotFound:
            return False
        if target.kind is AddressKind.NEW_QUEUE:
            return False   # replies never create queues
        raw = (b"\x00\x53\x73" + encode([None, None, str(reply_to), None, None, correlation])
               + b"\x00\x53\x74" + encode(info) + b"\x00\x53\x77" + encode(info))
        try:
            broker.publish(Message(raw), target)
        except AddressNotFound:
            return False
        return True


# ---------------------------------------------------------------------- duplicate detection


def _dedup_address(producer: Producer, target: Resolution, msg: Message) -> str:
    if producer.target is None:          # anonymous relay: the message's `to`
        return str(msg.prop("to"))
    address = producer.__dict__.get("dedup_address")
    if address is None:
        address = producer.link.remote_target.address or (
            target.name if target.key is None else f"{target.name}/{target.key}")
        producer.dedup_address = address
    return address


def dedup_publish(handler: "LinkOwner", producer: Producer, dlv: Any, msg: Message,
                  target: Resolution) -> bool:
    """Publish unless the message-id was already seen on this address.  True when
    the message was a duplicate: it has been settled (accepted) and dropped."""
    svc = service(handler.server)
    dedup = svc.dedup
    address = _dedup_address(producer, target, msg)
    key = id_key(msg.prop("message_id")) if msg.has_section(PROPERTIES) else None
    store = handler.server.store
    if key is not None and dedup.is_duplicate(address, key):
        dedup.dropped_total += 1
        log.debug("address %s: duplicate message-id %r dropped", address, msg.prop("message_id"))
        if lib.pn_delivery_settled(dlv):
            lib.pn_delivery_settle(dlv)
        elif store.persistent:
            # Accept once the original (queued in this or an earlier batch) is on disk.
            producer.accept_after_commit(dlv, store)
        else:
            producer.settle_in_order(dlv, ACCEPTED)
        return True
    handler.broker.publish(msg, target, handler.protocol.user)
    recorded = dedup.record(address, key)
    if recorded is not None and store.persistent:
        n, evicted = recorded
        skey = store_key(address, key)
        if len(skey) <= MAX_STORE_KEY:      # an address too long for an LMDB key: memory only
            store.put_record("dedup", skey, _U64.pack(n))
            for old in evicted:
                store.delete_record("dedup", store_key(address, old))
    return False


__all__ = ["ACK_ADDRESS", "CONTROL_ADDRESSES", "QUEUE_INFO_ADDRESS", "ControlLink", "RangeReader",
           "SequenceService", "attach_control", "attach_range_reader", "dedup_publish", "range_filter",
           "service"]
