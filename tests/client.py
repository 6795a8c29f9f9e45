"""A small synchronous AMQP client for tests, on python-qpid-proton's
BlockingConnection, with helpers to shape links exactly like Qpid JMS does."""

from __future__ import annotations

from typing import Any, Iterable

from proton import Described, Message, Terminus, symbol, ulong
from proton.reactor import DurableSubscription, Filter, LinkOption
from proton import ConnectionException, Timeout
from proton.utils import BlockingConnection, ConnectionClosed, LinkDetached

SELECTOR_KEY = symbol("jms-selector")
NO_LOCAL_KEY = symbol("no-local")


def put_symbols(data: Any, names: Iterable[str]) -> None:
    """Replace a terminus capabilities field with an array of symbols."""
    data.clear()
    data.put_array(False, 21)  # Data.SYMBOL
    data.enter()
    for name in names:
        data.put_symbol(symbol(name))
    data.exit()


class SourceOptions(LinkOption):
    """Set source fields of a receiver the way Qpid JMS does."""

    def __init__(self, *, capabilities: Iterable[str] = (), durable: int | None = None,
                 expiry: int | None = None, selector: str | None = None, no_local: bool = False,
                 distribution_mode: int | None = None, null_source: bool = False):
        self.capabilities = list(capabilities)
        self.durable = durable
        self.expiry = expiry
        self.selector = selector
        self.no_local = no_local
        self.distribution_mode = distribution_mode
        self.null_source = null_source

    def apply(self, link: Any) -> None:
        src = link.source
        if self.null_source:
            src.type = Terminus.UNSPECIFIED
            src.address = None
            return
        if self.capabilities:
            put_symbols(src.capabilities, self.capabilities)
        if self.durable is not None:
            src.durability = self.durable
        if self.expiry is not None:
            src.expiry_policy = self.expiry
        if self.distribution_mode is not None:
            src.distribution_mode = self.distribution_mode
        filters = {}
        if self.selector is not None:
            filters[SELECTOR_KEY] = Described(ulong(0x0000468C00000004), self.selector)
        if self.no_local:
            filters[NO_LOCAL_KEY] = Described(ulong(0x0000468C00000003), "NoLocalFilter{}")
        if filters:
            src.filter.put_object(filters)

    def test(self, link: Any) -> bool:
        return link.is_receiver


def connect(url: str, container_id: str | None = None, **kw: Any) -> BlockingConnection:
    """Open a blocking connection; `container_id` sets the AMQP container-id (the JMS
    clientID).  Extra keywords go to Container.connect (desired_capabilities, user,
    password, allowed_mechs, sasl_enabled, ssl_domain …)."""
    from proton.reactor import Container

    kw.setdefault("timeout", 10)
    container = Container()
    if container_id is not None:
        container.container_id = container_id
    return BlockingConnection(url, container=container, **kw)


__all__ = ["SourceOptions", "connect", "Message", "DurableSubscription", "Filter", "LinkDetached",
           "ConnectionException", "ConnectionClosed", "Terminus"]


def receive_all(url: str, address: str, *, credit: int = 100, timeout: float = 1.0) -> list:
    """Every message a competing consumer can take from `address` until nothing
    arrives for `timeout` seconds (each accepted)."""
    conn = connect(url)
    out = []
    try:
        rcv = conn.create_receiver(address, credit=credit)
        while True:
            try:
                out.append(rcv.receive(timeout=timeout))
            except Timeout:
                return out
            rcv.accept()
    finally:
        conn.close()


def terminus_capabilities(terminus: Any) -> set[str]:
    """The capabilities of a proton terminus as a set of strings."""
    data = terminus.capabilities
    data.rewind()
    if not data.next():
        return set()
    value = data.get_object()
    if hasattr(value, "elements"):
        value = value.elements
    if isinstance(value, str):
        value = [value]
    return {str(v) for v in value}


def terminus_filters(terminus: Any) -> dict:
    data = terminus.filter
    data.rewind()
    if not data.next():
        return {}
    return data.get_object() or {}


def is_null_terminus(terminus: Any) -> bool:
    return terminus.type == Terminus.UNSPECIFIED or (
        terminus.address is None and not terminus_capabilities(terminus))
