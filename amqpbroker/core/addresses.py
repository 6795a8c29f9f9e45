"""Address resolution, the Qpid Broker-J model the shared-subscription table assumes.

* `exchange/binding-key` when the address contains `/` past its first character;
  the exchange must exist.
* otherwise a queue of that name if one exists, else an exchange of that name;
* otherwise, for a terminus with the `topic` capability (Qpid JMS topics), the
  default topic exchange with the address as the key;
* otherwise a queue created on demand when auto-creation is on, else not-found.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable


TEMP_PREFIX = "amqpbroker.temp-"   # names of dynamic (temporary) nodes
RESERVED_PREFIX = "$amqpbroker."    # control addresses (queue-info, ack-below)


class AddressKind(str, enum.Enum):
    QUEUE = "queue"
    EXCHANGE = "exchange"
    NEW_QUEUE = "new-queue"


@dataclass(frozen=True)
class Resolution:
    kind: AddressKind
    name: str               # queue or exchange name
    key: str | None = None  # binding/routing key for exchanges (None: none given)


class AddressNotFound(LookupError):
    def __init__(self, address: str, why: str):
        super().__init__(why)
        self.address = address
        self.why = why


def split_address(address: str) -> tuple[str, str | None]:
    """`exchange/key` → ("exchange", "key"); anything else → (address, None)."""
    slash = address.find("/")
    if slash > 0:
        return address[:slash], address[slash + 1:]
    return address, None


def resolve(
    address: str,
    *,
    queue_exists: Callable[[str], bool],
    exchange_exists: Callable[[str], bool],
    topic: bool,
    auto_create: bool,
    topic_exchange: str = "amq.topic",
) -> Resolution:
    if not address:
        raise AddressNotFound(address, "empty address")
    head, key = split_address(address)
    if key is not None:
        if exchange_exists(head):
            return Resolution(AddressKind.EXCHANGE, head, key)
        if queue_exists(address):
            return Resolution(AddressKind.QUEUE, address)
        raise AddressNotFound(address, f"exchange '{head}' not found")
    if queue_exists(address):
        return Resolution(AddressKind.QUEUE, address)
    if exchange_exists(address):
        return Resolution(AddressKind.EXCHANGE, address)
    if address.startswith(TEMP_PREFIX):
        # A temporary node that is gone stays gone: never re-created on demand.
        raise AddressNotFound(address, f"temporary node '{address}' no longer exists")
    if address.startswith(RESERVED_PREFIX):
        # Broker control addresses are links of their own, never queues.
        raise AddressNotFound(address, f"'{address}' is a broker control address")
    if topic:
        return Resolution(AddressKind.EXCHANGE, topic_exchange, address)
    if auto_create:
        return Resolution(AddressKind.NEW_QUEUE, address)
    raise AddressNotFound(address, f"queue '{address}' not found")
