"""Translate proton termini to and from the pure terms of core.terms."""

from __future__ import annotations

from typing import Any

from proton import Data, Described, Terminus, symbol, ulong

from ..core.terms import Durability, ExpiryPolicy, Filter, SourceTerms, TargetTerms

_EXPIRY_FROM_PN = {
    Terminus.EXPIRE_WITH_LINK: ExpiryPolicy.LINK_DETACH,
    Terminus.EXPIRE_WITH_SESSION: ExpiryPolicy.SESSION_END,
    Terminus.EXPIRE_WITH_CONNECTION: ExpiryPolicy.CONNECTION_CLOSE,
    Terminus.EXPIRE_NEVER: ExpiryPolicy.NEVER,
}
_EXPIRY_TO_PN = {v: k for k, v in _EXPIRY_FROM_PN.items()}
_DIST_FROM_PN = {Terminus.DIST_MODE_COPY: "copy", Terminus.DIST_MODE_MOVE: "move"}
_DIST_TO_PN = {"copy": Terminus.DIST_MODE_COPY, "move": Terminus.DIST_MODE_MOVE}


def _data_object(data: Data) -> Any:
    data.rewind()
    if not data.next():
        return None
    return data.get_object()


def _symbols(data: Data) -> frozenset[str]:
    value = _data_object(data)
    if value is None:
        return frozenset()
    if hasattr(value, "elements"):  # proton Array
        value = value.elements
    if isinstance(value, (str, bytes)):
        value = [value]
    return frozenset(str(v) for v in value)


def _filters(data: Data) -> tuple[Filter, ...]:
    value = _data_object(data)
    if not isinstance(value, dict):
        return ()
    out = []
    for key, item in value.items():
        if isinstance(item, Described):
            descriptor = item.descriptor
            descriptor = int(descriptor) if isinstance(descriptor, int) else str(descriptor)
            out.append(Filter(str(key), descriptor, item.value))
        else:
            out.append(Filter(str(key), None, item))
    return tuple(out)


def read_source(t: Terminus) -> SourceTerms:
    return SourceTerms(
        address=t.address,
        durable=Durability(min(t.durability, 2)),
        expiry_policy=_EXPIRY_FROM_PN.get(t.expiry_policy, ExpiryPolicy.SESSION_END),
        timeout=t.timeout,
        dynamic=t.dynamic,
        distribution_mode=_DIST_FROM_PN.get(t.distribution_mode),
        capabilities=_symbols(t.capabilities),
        filters=_filters(t.filter),
    )


def read_target(t: Terminus) -> TargetTerms:
    return TargetTerms(
        address=t.address,
        durable=Durability(min(t.durability, 2)),
        expiry_policy=_EXPIRY_FROM_PN.get(t.expiry_policy, ExpiryPolicy.SESSION_END),
        dynamic=t.dynamic,
        capabilities=_symbols(t.capabilities),
        coordinator=(t.type == Terminus.COORDINATOR),
    )


def _put_symbols(data: Data, values: frozenset[str] | tuple[str, ...]) -> None:
    data.clear()
    if not values:
        return
    data.put_array(False, Data.SYMBOL)
    data.enter()
    for v in sorted(values):
        data.put_symbol(symbol(v))
    data.exit()


def write_source(t: Terminus, terms: SourceTerms) -> None:
    t.type = Terminus.SOURCE
    t.address = terms.address
    t.durability = int(terms.durable)
    t.expiry_policy = _EXPIRY_TO_PN[terms.expiry_policy]
    t.timeout = terms.timeout
    t.dynamic = terms.dynamic
    t.distribution_mode = _DIST_TO_PN.get(terms.distribution_mode, Terminus.DIST_MODE_UNSPECIFIED)
    _put_symbols(t.capabilities, terms.capabilities)
    data = t.filter
    data.clear()
    if terms.filters:
        data.put_object({symbol(f.key): (Described(_descriptor(f.descriptor), f.value)
                                         if f.descriptor is not None else f.value)
                         for f in terms.filters})


def _descriptor(d: Any) -> Any:
    return ulong(d) if isinstance(d, int) else symbol(d)


def write_target(t: Terminus, terms: TargetTerms) -> None:
    t.type = Terminus.COORDINATOR if terms.coordinator else Terminus.TARGET
    t.address = terms.address
    if not terms.coordinator:
        t.durability = int(terms.durable)
        t.expiry_policy = _EXPIRY_TO_PN[terms.expiry_policy]
        t.dynamic = terms.dynamic
    _put_symbols(t.capabilities, terms.capabilities)


def write_null(t: Terminus) -> None:
    """A null terminus in the attach reply: the way to refuse a link that Qpid JMS
    and other clients understand (AMQP 1.0 §2.6.3)."""
    t.type = Terminus.UNSPECIFIED
    t.address = None
