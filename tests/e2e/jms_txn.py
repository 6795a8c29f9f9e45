"""A transacted-session client shaped like Qpid JMS's (shared/notes/qpid-jms-wire.md):
coordinator link `qpid-jms:coordinator:<session>`, numeric descriptors, transfers in
transactional-state, settled transactional acknowledgements."""

from __future__ import annotations

import uuid
from typing import Any

from proton import Delivery, Described, Message, Terminus, symbol, ulong

from tests.e2e.helpers_conn import REMOTE_ACTIVE, REMOTE_CLOSED, RawClient

DECLARE, DISCHARGE, DECLARED, TXN_STATE = 0x31, 0x32, 0x33, 0x34
ACCEPTED_OUTCOME = Described(ulong(0x24), [])


class TxnSession:
    def __init__(self, client: RawClient):
        self.client = client
        self.session = client.session()
        self.coordinator = self.session.sender(f"qpid-jms:coordinator:ID:{uuid.uuid4()}:1:1")
        tgt = self.coordinator.target
        tgt.type = Terminus.COORDINATOR
        tgt.capabilities.put_array(False, 21)  # Data.SYMBOL
        tgt.capabilities.enter()
        tgt.capabilities.put_symbol(symbol("amqp:local-transactions"))
        tgt.capabilities.exit()
        self.coordinator.open()
        client.wait(lambda: self.coordinator.state & (REMOTE_ACTIVE | REMOTE_CLOSED), what="coordinator attach")
        client.wait(lambda: self.coordinator.credit > 0, what="coordinator credit")
        self._tags = 0

    def _tag(self) -> str:
        self._tags += 1
        return f"t{self._tags}"

    def request(self, body: Any) -> Delivery:
        dlv = self.coordinator.send(Message(body=body), tag=self._tag())
        return dlv

    def wait_outcome(self, dlv: Delivery) -> Delivery:
        self.client.wait(lambda: dlv.remote_state or dlv.settled, what="coordinator outcome")
        return dlv

    def declare(self) -> bytes:
        dlv = self.wait_outcome(self.request(Described(ulong(DECLARE), [None])))
        assert dlv.remote_state == DECLARED, dlv.remote_state
        return bytes(dlv.remote.data[0])

    def discharge(self, txn: bytes, fail: bool = False) -> Delivery:
        return self.wait_outcome(self.request(Described(ulong(DISCHARGE), [txn, fail])))

    def sender(self, address: str):
        return self.client.sender(self.session, address, f"qpid-jms:sender:ID:{uuid.uuid4()}:1:1:1:{address}")

    def receiver(self, address: str, credit: int = 10):
        rcv = self.client.receiver(self.session, address,
                                   f"qpid-jms:receiver:ID:{uuid.uuid4()}:1:1:1:{address}")
        rcv.flow(credit)
        return rcv

    def send(self, snd, body: Any, txn: bytes | None, durable: bool = False, group_id: str | None = None) -> Delivery:
        dlv = snd.delivery(self._tag())
        if txn is not None:
            dlv.local.data = [txn]
            dlv.update(TXN_STATE)
        snd.stream(Message(body=body, durable=durable, group_id=group_id).encode())
        snd.advance()
        self.client.wait(lambda: dlv.remote_state or dlv.settled, what="send outcome")
        return dlv

    def receive(self, rcv, timeout: float = 10.0) -> tuple[Delivery, Message]:
        self.client.wait(lambda: rcv.current is not None and not rcv.current.partial, timeout, "message")
        dlv = rcv.current
        msg = Message()
        msg.decode(rcv.recv(dlv.pending))
        rcv.advance()
        return dlv, msg

    def ack(self, dlv: Delivery, txn: bytes | None) -> None:
        if txn is None:
            dlv.update(Delivery.ACCEPTED)
        else:
            dlv.local.data = [txn, ACCEPTED_OUTCOME]
            dlv.update(TXN_STATE)
        dlv.settle()
        self.client.pump(0)
