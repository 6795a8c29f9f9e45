"""Terminus terms as plain values (AMQP 1.0 §3.5.3 source, §3.5.4 target).

The I/O layer reads proton termini into these and writes decisions back; every
broker decision works on these values only, so it can be tested without a socket.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any


class Durability(int, enum.Enum):
    """terminus-durability, AMQP 1.0 §3.5.5."""
    NONE = 0
    CONFIGURATION = 1
    UNSETTLED_STATE = 2


class ExpiryPolicy(str, enum.Enum):
    """terminus-expiry-policy, AMQP 1.0 §3.5.6."""
    LINK_DETACH = "link-detach"
    SESSION_END = "session-end"
    CONNECTION_CLOSE = "connection-close"
    NEVER = "never"


# Capabilities (symbols) the JMS mapping uses on sources/targets.
CAP_QUEUE = "queue"
CAP_TOPIC = "topic"
CAP_SHARED = "shared"
CAP_GLOBAL = "global"
CAP_TEMP_QUEUE = "temporary-queue"
CAP_TEMP_TOPIC = "temporary-topic"

# Filter keys/descriptors (Qpid JMS; AMQP filter registry, apache.org codes 0x468C).
SELECTOR_DESCRIPTORS = (0x0000468C00000004, "apache.org:selector-filter:string")
NO_LOCAL_DESCRIPTORS = (0x0000468C00000003, "apache.org:no-local-filter:list")


@dataclass(frozen=True)
class Filter:
    """One entry of a source filter-set: the map key and the described value."""
    key: str
    descriptor: Any
    value: Any


@dataclass(frozen=True)
class SourceTerms:
    address: str | None = None
    durable: Durability = Durability.NONE
    expiry_policy: ExpiryPolicy = ExpiryPolicy.SESSION_END   # the §3.5.3 default
    timeout: int = 0
    dynamic: bool = False
    distribution_mode: str | None = None                     # "move" / "copy"
    capabilities: frozenset[str] = frozenset()
    filters: tuple[Filter, ...] = ()
    default_outcome: Any = None
    outcomes: tuple[str, ...] = ()

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    @property
    def is_null(self) -> bool:
        """proton reads an absent source as an unspecified terminus: no address,
        no capabilities and no filter is the practical null-source test."""
        return self.address is None and not self.capabilities and not self.filters and not self.dynamic

    def with_(self, **changes: Any) -> "SourceTerms":
        return replace(self, **changes)

    def filter_matching(self, descriptors: tuple) -> Filter | None:
        for f in self.filters:
            if f.descriptor in descriptors:
                return f
        return None

    @property
    def selector(self) -> str | None:
        f = self.filter_matching(SELECTOR_DESCRIPTORS)
        if f is None or f.value is None:
            return None
        text = str(f.value).strip()
        return text or None

    @property
    def no_local(self) -> bool:
        return self.filter_matching(NO_LOCAL_DESCRIPTORS) is not None

    def honoured_filters(self) -> tuple[Filter, ...]:
        """The filters the broker applies (JMS selector, no-local): the only ones a
        reply source may echo (AMQP 1.0 §3.5.3: unsupported filters are left out)."""
        return tuple(f for f in self.filters
                     if f.descriptor in SELECTOR_DESCRIPTORS or f.descriptor in NO_LOCAL_DESCRIPTORS)


@dataclass(frozen=True)
class TargetTerms:
    address: str | None = None
    durable: Durability = Durability.NONE
    expiry_policy: ExpiryPolicy = ExpiryPolicy.SESSION_END
    dynamic: bool = False
    capabilities: frozenset[str] = frozenset()
    coordinator: bool = False

    def has(self, capability: str) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True)
class LinkRef:
    """Who is attaching: the link name and the peer's container-id."""
    name: str
    container_id: str
    extra: dict = field(default_factory=dict, compare=False, hash=False)
