"""A producer on an exchange named without a key (`routes`, `amq.topic`), in a cluster.

Alone, the broker routes each of its messages by the message's subject (the key; ""
without one: core/broker.py `route`).  In a cluster the key decides the owning node
(core/placement.py `place_message`: `exchange/subject`), so the client's link stays
on the node it is connected to and each message goes to its key's owner: on a
sender whose target is the exchange itself, one per node (the owner routes it by its
subject exactly as alone), this node's own share through its inter-node listener
like any other.  A subject that names a partitioned destination goes to one of its
members (group, else the link's member), as a producer on it would.

Everything else is a partitioned producer's (cluster/partitioned.py): the client's
deliveries are settled in the order they came, each with its owner's outcome
(Accepted only once that node has committed it); transactions go whole to one node
(cluster/txn.py).
"""

from __future__ import annotations

import zlib
from typing import Any

from proton import Link

from ..core.message import PROPERTIES, Message
from ..core.placement import Forward, Local, Partitioned, Refuse, place_message
from .partitioned import PartitionedProducer, Unplaced, member_of


class KeylessProducer(PartitionedProducer):
    """The client's producer link on `exchange`, placed per message by subject."""

    def __init__(self, side: Any, handler: Any, link: Link, exchange: str):
        self.exchange = exchange
        self.router = side.router
        self.link_hash = zlib.crc32(link.name.encode("utf-8", "surrogatepass"))
        super().__init__(side, handler, link, None)

    def choose(self, msg: Message) -> tuple[str, str]:
        subject = msg.prop("subject") if msg.has_section(PROPERTIES) else None
        router = self.router
        placed = place_message(None, False, router.node, router.slots, router.exchanges,
                               subject=None if subject is None else str(subject), exchange=self.exchange)
        if isinstance(placed, Local):
            return self.exchange, router.node
        if isinstance(placed, Forward):
            return self.exchange, placed.node
        if isinstance(placed, Partitioned):
            members = placed.members
            return members[member_of(msg.group_id(), self.link_hash % len(members), len(members))]
        if isinstance(placed, Refuse):
            raise Unplaced(placed.condition, placed.description)
        raise Unplaced("amqp:not-implemented", f"no owner for subject {subject!r} on '{self.exchange}'")
