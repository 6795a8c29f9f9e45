"""Receivers shaped exactly like Qpid JMS's subscription links (see
shared/notes/qpid-jms-wire.md): names, capabilities, durability, expiry, filters."""

from __future__ import annotations

import uuid
from typing import Any

from proton import Endpoint, Terminus, Timeout
from proton.utils import BlockingConnection, BlockingReceiver

from tests.client import SourceOptions

UNSETTLED_STATE = 2


def sub_link_name(sub: str, n: int = 1, *, global_: bool = False, durable: bool = True) -> str:
    """The link name Qpid JMS gives the n-th consumer of a subscription on a connection."""
    if durable:
        if global_:
            return f"{sub}|global" if n == 1 else f"{sub}|global{n}"
        return sub if n == 1 else f"{sub}|{n}"
    return f"{sub}|global-volatile{n}" if global_ else f"{sub}|volatile{n}"


def shared_consumer(conn: BlockingConnection, topic: str, sub: str, n: int = 1, *, global_: bool = False,
                    durable: bool = True, selector: str | None = None, no_local: bool = False,
                    credit: int = 100) -> BlockingReceiver:
    caps = ["topic", "shared"] + (["global"] if global_ else [])
    opts = SourceOptions(capabilities=caps,
                         durable=UNSETTLED_STATE if durable else 0,
                         expiry=Terminus.EXPIRE_NEVER if durable else Terminus.EXPIRE_WITH_LINK,
                         selector=selector, no_local=no_local,
                         distribution_mode=Terminus.DIST_MODE_COPY if durable else None)
    return conn.create_receiver(topic, name=sub_link_name(sub, n, global_=global_, durable=durable),
                                options=opts, credit=credit)


def durable_consumer(conn: BlockingConnection, topic: str, sub: str, *, selector: str | None = None,
                     no_local: bool = False, global_: bool = False, credit: int = 100) -> BlockingReceiver:
    """An unshared durable subscriber (createDurableConsumer): link name = subscription name."""
    caps = ["topic"] + (["global"] if global_ else [])
    opts = SourceOptions(capabilities=caps, durable=UNSETTLED_STATE, expiry=Terminus.EXPIRE_NEVER,
                         selector=selector, no_local=no_local, distribution_mode=Terminus.DIST_MODE_COPY)
    return conn.create_receiver(topic, name=sub, options=opts, credit=credit)


def topic_consumer(conn: BlockingConnection, topic: str, *, selector: str | None = None,
                   no_local: bool = False, credit: int = 100) -> BlockingReceiver:
    opts = SourceOptions(capabilities=["topic"], selector=selector, no_local=no_local,
                         expiry=Terminus.EXPIRE_WITH_LINK)
    return conn.create_receiver(topic, name=f"qpid-jms:receiver:ID:{uuid.uuid4()}:1:1:1:{topic}",
                                options=opts, credit=credit)


def null_source_attach(conn: BlockingConnection, name: str) -> BlockingReceiver:
    """The lookup Qpid JMS does before unsubscribe / durable re-subscribe."""
    return conn.create_receiver(None, name=name, options=SourceOptions(null_source=True), credit=0)


class _DetachWatcher:
    """Link handler that notes the peer's detach (proton keeps a detached link's
    remote state ACTIVE, so only the event tells) and passes everything else on."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.detached = False
        self.handlers = []

    def on_link_remote_detach(self, event: Any) -> None:
        self.detached = True

    def on_unhandled(self, method: str, *args: Any) -> None:
        fn = getattr(self.inner, method, None)
        if fn is not None:
            fn(*args)
        elif hasattr(self.inner, "on_unhandled"):
            self.inner.on_unhandled(method, *args)


def detach(conn: BlockingConnection, receiver: BlockingReceiver, timeout: float = 10) -> Any:
    """Detach with closed=false (a durable consumer's close) and wait for the reply."""
    link = receiver.link
    watcher = _DetachWatcher(link.handler)
    link.handler = watcher
    link.detach()
    conn.wait(lambda: watcher.detached or not (link.state & Endpoint.REMOTE_ACTIVE), timeout=timeout,
              msg="waiting for the broker's detach")
    return link.remote_condition


def close(conn: BlockingConnection, receiver: BlockingReceiver, timeout: float = 10) -> Any:
    """Detach with closed=true (unsubscribe / non-durable close); return the broker's condition."""
    link = receiver.link
    link.close()
    conn.wait(lambda: not (link.state & Endpoint.REMOTE_ACTIVE), timeout=timeout,
              msg="waiting for the broker's detach")
    return link.remote_condition


def drain_bodies(receiver: BlockingReceiver, timeout: float = 0.5) -> list:
    """Receive and accept until nothing arrives for `timeout` seconds (used only to
    collect what is already flowing; absence checks say so where they are made)."""
    out = []
    while True:
        try:
            msg = receiver.receive(timeout=timeout)
        except Timeout:
            return out
        out.append(msg.body)
        receiver.accept()
