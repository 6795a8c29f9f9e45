"""Shared helpers for the addressing / delivery / outcome end-to-end tests.

Everything here drives a real broker over AMQP with python-qpid-proton's
BlockingConnection; waits are on protocol events (with timeouts); the only sleep is
`let_time_pass`, for tests where elapsed time is the feature (TTL, expiry).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Iterator

from proton import Delivery, Message, Terminus, Timeout, symbol
from proton.reactor import LinkOption
from proton.utils import BlockingConnection, BlockingReceiver, BlockingSender, LinkDetached

from tests.client import connect, put_symbols

# A "nothing arrives" check waits this long.  It can only ever make such a test
# pass wrongly on a very slow machine, never fail it wrongly.
QUIET = 0.5
# Waits for something that must happen.
WAIT = 10.0


def uid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def word() -> str:
    """A unique topic word (no dots)."""
    return "w" + uuid.uuid4().hex[:10]


@contextlib.contextmanager
def connection(broker: Any, **kw: Any) -> Iterator[BlockingConnection]:
    conn = connect(broker.url, **kw)
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(Exception):
            conn.close()
        raise
    conn.close()


class TargetOptions(LinkOption):
    """Target capabilities (Qpid JMS marks topic producers with `topic`)."""

    def __init__(self, capabilities: list[str]):
        self.capabilities = capabilities

    def apply(self, link: Any) -> None:
        put_symbols(link.target.capabilities, self.capabilities)

    def test(self, link: Any) -> bool:
        return link.is_sender


def receiver(conn: BlockingConnection, address: str | None, credit: int | None = 10,
             **kw: Any) -> BlockingReceiver:
    """A receiver with a unique link name (proton's default name is container-id +
    address, which clashes when one connection opens two links to one address).
    `credit` is a prefetch window proton tops up; None grants nothing."""
    kw.setdefault("name", uid("rcv"))
    return conn.create_receiver(address, credit=credit, **kw)


def sender(conn: BlockingConnection, address: str | None, **kw: Any) -> BlockingSender:
    kw.setdefault("name", uid("snd"))
    return conn.create_sender(address, **kw)


def barrier(conn: BlockingConnection) -> None:
    """A protocol round trip: the broker handles a connection's frames in order,
    so once the attach of a throw-away link is answered, every disposition and
    flow sent before it has been processed."""
    snd = conn.create_sender(None, name=uid("barrier"))
    snd.close()


def send(conn: BlockingConnection, address: str | None, *messages: Message, **kw: Any) -> None:
    """Send and wait until each message is settled (accepted) by the broker."""
    snd = sender(conn, address, **kw)
    for m in messages:
        snd.send(m)
    snd.close()


def send_bodies(conn: BlockingConnection, address: str, bodies: list[Any], **props: Any) -> None:
    send(conn, address, *[Message(body=b, **props) for b in bodies])


def fetch(conn: BlockingConnection, rcv: BlockingReceiver, timeout: float = WAIT) -> tuple[Message, Delivery]:
    """The next message and its delivery (left unsettled) on a receiver.
    Does not grant credit: the receiver must have some (or a prefetch window)."""
    conn.wait(lambda: rcv.fetcher.has_message, timeout=timeout,
              msg=f"waiting for a message on {rcv.link.name}")
    return rcv.fetcher.incoming.popleft()


def fetch_body(conn: BlockingConnection, rcv: BlockingReceiver, timeout: float = WAIT) -> Any:
    msg, dlv = fetch(conn, rcv, timeout)
    settle(dlv, Delivery.ACCEPTED)
    return msg.body


def nothing_arrives(conn: BlockingConnection, rcv: BlockingReceiver, timeout: float = QUIET) -> bool:
    """True when no message arrives within `timeout` (a short, deliberate window:
    "nothing arrives" cannot be observed as an event)."""
    try:
        conn.wait(lambda: rcv.fetcher.has_message, timeout=timeout)
    except Timeout:
        return True
    return False


def drain_bodies(conn: BlockingConnection, rcv: BlockingReceiver, timeout: float = QUIET) -> list[Any]:
    """Accept and return everything that arrives until nothing more comes within `timeout`."""
    out = []
    while True:
        try:
            msg, dlv = fetch(conn, rcv, timeout)
        except Timeout:
            return out
        settle(dlv, Delivery.ACCEPTED)
        out.append(msg.body)


def settle(dlv: Delivery, state: int, *, failed: bool = False, undeliverable: bool = False) -> None:
    """Settle a received delivery with an outcome (sent at the next event-loop turn)."""
    if state == Delivery.MODIFIED:
        dlv.local.failed = failed
        dlv.local.undeliverable = undeliverable
    dlv.update(state)
    dlv.settle()


def dead_letters(broker: Any, address: str = "DLQ") -> list[tuple]:
    """(body, delivery-count) of everything on the dead-letter queue, consumed.  A
    cluster's dead letters arrive a hop later (`dead_letter_wait`)."""
    out = []
    with connection(broker) as conn:
        rcv = receiver(conn, address, credit=20)
        first = getattr(broker, "dead_letter_wait", QUIET)
        while not nothing_arrives(conn, rcv, first if not out else QUIET):
            msg, dlv = fetch(conn, rcv)
            settle(dlv, Delivery.ACCEPTED)
            out.append((msg.body, msg.delivery_count))
    return out


def wait_settled(conn: BlockingConnection, dlv: Delivery, timeout: float = WAIT) -> None:
    conn.wait(lambda: dlv.remote_state != 0 or dlv.settled, timeout=timeout,
              msg="waiting for the broker to settle a delivery")


def expect_refused(fn: Any, *args: Any, **kw: Any) -> LinkDetached:
    """Call fn (a link-creating call) and return the LinkDetached it must raise."""
    try:
        link = fn(*args, **kw)
    except LinkDetached as exc:
        return exc
    raise AssertionError(f"link was not refused: {link.link.name}")


def let_time_pass(seconds: float) -> None:
    """Wait for wall-clock time to pass when time itself is the feature under test
    (TTL, absolute expiry).  Never used to wait for the broker to do something."""
    if seconds > 0:
        time.sleep(seconds)


def annotated(body: Any, annotations: dict, **kw: Any) -> Message:
    return Message(body=body, annotations={symbol(k): v for k, v in annotations.items()}, **kw)


__all__ = ["QUIET", "WAIT", "uid", "word", "connection", "TargetOptions", "receiver", "sender", "barrier", "send",
           "send_bodies", "fetch", "fetch_body", "nothing_arrives", "drain_bodies", "settle",
           "dead_letters", "wait_settled", "expect_refused", "let_time_pass", "annotated", "Terminus", "Delivery", "Message",
           "Timeout", "LinkDetached"]
