"""Producers shaped exactly like Qpid JMS's (shared/notes/qpid-jms-wire.md), on a
`RawClient` session, so that a test decides when each transfer goes out:

* link name `qpid-jms:sender:<producerId>:<address>`, target capability `queue`
  (or a null target address for the anonymous relay), source address the link name,
  snd-settle-mode unsettled, rcv-settle-mode first;
* messages with message-id `ID:…`, `to` (the destination, on every message, as Qpid JMS
  sets it), `x-opt-jms-dest` and `x-opt-jms-msg-type` annotations, durable (persistent,
  the JMS default) unless told otherwise;
* `send_async`: CompletionListener sends — the transfer goes out at once, without
  waiting for the previous one's outcome; `send_sync`: a persistent send outside a
  transaction, which waits for the broker's outcome (and for credit first).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from proton import Delivery, Link, Message, symbol

from tests.e2e.helpers_conn import REMOTE_ACTIVE, REMOTE_CLOSED, RawClient

JMS_DEST = symbol("x-opt-jms-dest")
JMS_MSG_TYPE = symbol("x-opt-jms-msg-type")
TEXT_MESSAGE = 5
_ids = itertools.count(1)


class JmsProducer:
    def __init__(self, client: RawClient, session: Any, address: str | None):
        self.client = client
        self.producer_id = f"ID:{uuid.uuid4()}:1:1:{next(_ids)}"
        name = f"qpid-jms:sender:{self.producer_id}:{address or ''}"
        link = session.sender(name)
        link.source.address = name
        link.target.address = address
        if address is not None:
            caps = link.target.capabilities
            caps.put_array(False, 21)   # symbol array
            caps.enter()
            caps.put_symbol(symbol("queue"))
            caps.exit()
        link.snd_settle_mode = Link.SND_UNSETTLED
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        client.wait(lambda: link.state & (REMOTE_ACTIVE | REMOTE_CLOSED), what=f"attach of {name}")
        self.link = link
        self.address = address
        self.sent = 0

    def message(self, body: Any, *, durable: bool = True, to: str | None = None) -> Message:
        self.sent += 1
        return Message(body=body, durable=durable, id=f"{self.producer_id}:{self.sent}", address=to or self.address,
                       annotations={JMS_DEST: 0, JMS_MSG_TYPE: TEXT_MESSAGE})

    def send_async(self, body: Any, *, durable: bool = True, to: str | None = None) -> Delivery:
        """The transfer is queued on the link (it goes out when there is credit) and not
        waited for."""
        link = self.link
        dlv = link.delivery(f"{self.producer_id}:{self.sent + 1}")
        link.send(self.message(body, durable=durable, to=to).encode())
        link.advance()
        return dlv

    def send_sync(self, body: Any, *, durable: bool = True, to: str | None = None,
                  timeout: float = 10.0) -> Delivery:
        dlv = self.send_async(body, durable=durable, to=to)
        self.client.wait(lambda: dlv.remote_state or dlv.settled, timeout, "send outcome")
        return dlv


def outcome(dlv: Delivery) -> int | None:
    return dlv.remote_state if dlv.remote_state else None


__all__ = ["JmsProducer", "outcome"]
