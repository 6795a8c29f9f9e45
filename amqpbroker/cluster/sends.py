"""Messages passed on to the owning node over one sender link, in the order the client
sent them, within the credit that node gives; a transactional one under that node's
txn-id once it is known (cluster/txn.py).  The owner's outcome goes back to the
client's delivery, the client's own txn-id put back in a transactional outcome.

Shared by a forwarded producer (cluster/forward.py: the client's link is forwarded
whole) and the anonymous relay (cluster/relay.py: each message goes to the owner of
its own `to`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from cproton import ffi, lib
from proton import Condition

from .deliveries import Tags
from .txn import TRANSACTIONAL_STATE, set_txn_state, txn_state_data

_WAITING = object()   # the owner's txn-id is being declared


class Outgoing:
    """One client message on its way to the owner."""

    __slots__ = ("cdlv", "buf", "txn_id", "xid", "error", "slot")

    def __init__(self, cdlv: Any, buf: Any, slot: Any = None):
        self.cdlv = cdlv
        self.buf = buf
        self.txn_id: bytes | None = None
        self.xid: Any = None
        self.error: tuple[str, str] | None = None   # (condition, description)
        self.slot = slot           # the relay's place in the client producer's settlement order


class OrderedSender:
    """The sending half: subclasses give `mimpl` (our sender link, once attached),
    `peer`, `handler`, and say how an outcome reaches the client."""

    mimpl: Any
    peer: Any
    handler: Any

    def init_sends(self) -> None:
        self.out_tags = Tags()
        self.queue: deque[Outgoing] = deque()   # not sent yet (no credit, txn being declared)
        self.sent: dict[Any, Outgoing] = {}     # our pn_delivery_t* → what it carries

    def busy(self) -> bool:
        return bool(self.sent) or bool(self.queue)

    def pass_on(self, item: Outgoing, address: str) -> None:
        """Send `item` to the owner (now, or in its turn)."""
        if lib.pn_delivery_remote_state(item.cdlv) == TRANSACTIONAL_STATE:
            data = txn_state_data(item.cdlv)
            item.txn_id = bytes(data[0]) if data and isinstance(data[0], (bytes, bytearray, memoryview)) else b""
            item.xid = _WAITING
            self.queue.append(item)
            self.handler.server.cluster.txns.route(self.handler, item.txn_id, self.peer.node, address,
                                                   lambda xid, error: self._declared(item, xid, error))
            return
        if self.queue or not self.can_send():
            self.queue.append(item)
            return
        self._send(item)

    def can_send(self) -> bool:
        return self.mimpl is not None and lib.pn_link_credit(self.mimpl) > 0

    def _declared(self, item: Outgoing, xid: bytes | None, error: tuple[str, str] | None) -> None:
        item.xid, item.error = xid, error
        self.send_queued()

    def send_queued(self) -> None:
        q = self.queue
        while q and q[0].xid is not _WAITING:
            item = q[0]
            if item.error is not None:
                q.popleft()
                self.refuse(item, *item.error)
                continue
            if not self.can_send():
                return
            q.popleft()
            self._send(item)

    def _send(self, item: Outgoing) -> None:
        m = self.mimpl
        mdlv = lib.pn_delivery(m, self.out_tags.next())
        if item.xid is not None:
            set_txn_state(mdlv, item.xid)
        lib.pn_link_send(m, ffi.from_buffer(item.buf), len(item.buf))
        lib.pn_link_advance(m)
        if lib.pn_delivery_settled(item.cdlv):   # pre-settled by the client: nothing to answer
            lib.pn_delivery_settle(mdlv)
            self.presettled(item)
        else:
            self.sent[mdlv] = item
        self.peer.mark_dirty()

    def outcome(self, mdlv: Any) -> None:
        """The owner's disposition of one of ours."""
        settled = lib.pn_delivery_settled(mdlv)
        if not (settled or lib.pn_delivery_updated(mdlv)):
            return
        item = self.sent.pop(mdlv, None) if settled else self.sent.get(mdlv)
        if item is None:
            if settled:
                lib.pn_delivery_settle(mdlv)
            return
        self.answer(item, mdlv, settled)
        if settled:
            lib.pn_delivery_settle(mdlv)

    def fail_all(self, condition: str, description: str) -> None:
        """The owner will not answer: every message waiting on it fails."""
        items = list(self.sent.values()) + list(self.queue)
        self.sent, self.queue = {}, deque()
        for item in items:
            self.refuse(item, condition, description)

    # --- how the client hears of it (subclasses)

    def answer(self, item: Outgoing, mdlv: Any, settled: bool) -> None:   # pragma: no cover
        raise NotImplementedError

    def refuse(self, item: Outgoing, condition: str, description: str) -> None:   # pragma: no cover
        raise NotImplementedError

    def presettled(self, item: Outgoing) -> None:   # pragma: no cover
        raise NotImplementedError


def owner_state(item: Outgoing, mdlv: Any) -> tuple[int, Any, Condition | None]:
    """The owner's outcome for the client: (state, data, condition), a transactional
    one carrying the client's txn-id instead of the owner's."""
    from proton import Delivery
    remote = Delivery.wrap(mdlv).remote
    state = lib.pn_delivery_remote_state(mdlv)
    data = remote.data if state not in (0, lib.PN_ACCEPTED) else None
    if state == TRANSACTIONAL_STATE:
        fields = list(data or [])
        data = [item.txn_id] + fields[1:2]
    cond = remote.condition if state == lib.PN_REJECTED else None
    return state, data, cond


def write_state(dlv: Any, state: int, data: Any, cond: Condition | None) -> None:
    """Put an outcome on our side of the client's delivery."""
    if state == TRANSACTIONAL_STATE:
        set_txn_state(dlv, data[0], data[1] if len(data) > 1 else None)
        return
    if cond is not None:
        local = lib.pn_delivery_local(dlv)
        c = lib.pn_disposition_condition(local)
        lib.pn_condition_set_name(c, (cond.name or "").encode())
        if cond.description:
            lib.pn_condition_set_description(c, cond.description.encode())
    if state:
        lib.pn_delivery_update(dlv, state)
