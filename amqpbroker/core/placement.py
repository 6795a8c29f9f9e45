"""Where a link or a message goes in a cluster: the node that owns its address.

Pure: no sockets, no proton.  The I/O (amqpbroker/cluster/) asks `place_link` at
every attach and `place_message` for each message of a per-message producer
(anonymous relay, an exchange named without a key), and acts on the answer.

**Ownership.**  Every queue, topic and subscription has exactly one owning node, so
every JMS rule runs unchanged on its owner.  An address is normalised to its *owning
key* (`owning_key`), the key is hashed to one of `SlotMap.slots` slots (CRC-32, the
same on every node and every run), and the slot map says which node holds the slot.

**The owning key of each link shape** (the table `place_link` implements; a test per
row in tests/core/test_placement.py):

| link shape                                        | owning key                         |
|---------------------------------------------------|------------------------------------|
| consumer / producer on a queue `q`                | `q`                                |
| topic `t` (`topic` capability, or `amq.topic/t`)  | `amq.topic/t`                      |
| `exchange/key` on a direct or topic exchange      | `exchange/key`                     |
| a fanout exchange, or a pinned exchange           | the exchange's name                |
| subscription (durable or not, shared or not,      | its topic's key: a subscription    |
| with or without a client-id) with a source        | lives beside its topic             |
| wildcard binding key on an unpinned topic exch.   | refused (no single owner)          |
| null-source receiver (unsubscribe, lookup)        | unknown: asked of every node       |
| producer on an exchange without a key             | per message (`subject`)            |
| anonymous relay (null target address)             | per message (`to`)                 |
| dynamic source / target (temporary node)          | the creating connection's node     |
| temporary address `amqpbroker.temp-queue.<node>.` | the node named in it               |
| transaction coordinator, `$amqpbroker.` controls  | the node the client is on          |
| a subscription's queue named directly (`qpidsub_/`)| the node the client is on          |
| a partitioned address                             | its members (`partitioned`)        |
| a member name it does not have (`orders.p2`, 2)   | producer: refused (not-found)      |
| a connection's client-id (sole-connection-...)    | `$client-id/<container-id>`        |

A subscription is placed by its topic and not by its key (client-id + name) because
the subscription queue must see every message routed through the topic, and the
topic's routing happens on one node; the price is that a null-source attach (which
carries only the name) is looked up on every node (`Scatter`), which Qpid JMS does
only to unsubscribe.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Union

from .addresses import RESERVED_PREFIX, TEMP_PREFIX, split_address
from .numbers import ascii_int

DEFAULT_SLOTS = 256
TOPIC_EXCHANGE = "amq.topic"

# The error a client gets when the node owning its address is away (not an AMQP
# 1.0 §2.8.15 condition: those have no "unavailable"; a broker's own symbol).
UNAVAILABLE = "amqpbroker:resource-unavailable"
NOT_IMPLEMENTED = "amqp:not-implemented"
NOT_FOUND = "amqp:not-found"

# Exchange types as the placement sees them (core/exchanges.ExchangeType values).
DIRECT, TOPIC, FANOUT = "direct", "topic", "fanout"


def slot_of(key: str, slots: int = DEFAULT_SLOTS) -> int:
    """The slot an owning key hashes to: stable across nodes, runs and versions."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % slots


# ---------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Local:
    """This node owns it: today's single-broker path."""


@dataclass(frozen=True)
class Forward:
    """Another node owns it: forward the link (or message) to `node`."""
    node: str
    key: str = ""


@dataclass(frozen=True)
class Scatter:
    """Nobody can tell from the link alone: ask this node first, then `nodes`."""
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PerMessage:
    """A producer whose messages each name their own destination (`to`, `subject`)."""


@dataclass(frozen=True)
class Partitioned:
    """A partitioned destination: (member address, owning node) per member."""
    address: str
    members: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Refuse:
    condition: str
    description: str


Placement = Union[Local, Forward, Scatter, PerMessage, Partitioned, Refuse]
LOCAL = Local()
PER_MESSAGE = PerMessage()


# ---------------------------------------------------------------------- the map


@dataclass(frozen=True)
class SlotMap:
    """Which node holds each slot, and which nodes are up.  `epoch` grows with every
    change of the map (ZooKeeper's version in a [cluster]; 0 for a static map)."""
    owners: tuple[str, ...]
    live: frozenset[str] = frozenset()
    epoch: int = 0
    pinned: frozenset[str] = frozenset()           # exchanges owned whole (wildcards allowed)
    partitioned: Mapping[str, int] = field(default_factory=dict)   # owning key → member count

    @property
    def slots(self) -> int:
        return len(self.owners)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node of the map, in a fixed order (sorted)."""
        return tuple(sorted(set(self.owners) | set(self.live)))

    def owner(self, key: str) -> str:
        return self.owners[slot_of(key, self.slots)]

    def available(self, node: str) -> bool:
        return node in self.live

    def with_live(self, live: Iterable[str]) -> "SlotMap":
        return SlotMap(self.owners, frozenset(live), self.epoch, self.pinned, self.partitioned)

    def slots_of(self, node: str) -> list[int]:
        return [s for s, n in enumerate(self.owners) if n == node]


def map_id(slots: SlotMap) -> int:
    """What two nodes must share to place every address alike, as 64 bits: the map's
    epoch and owners, and the pinned exchanges and partitioned destinations (from each
    node's configuration).  Not which nodes are live.  The inter-node handshake carries
    it (cluster/wire.py): nodes that would place differently never forward to each other."""
    text = json.dumps([slots.epoch, list(slots.owners), sorted(slots.pinned), sorted(slots.partitioned.items())])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def spread(nodes: Iterable[str], weights: Mapping[str, int] | None = None,
           slots: int = DEFAULT_SLOTS) -> tuple[str, ...]:
    """A static map: slots in contiguous runs, each node's run in proportion to its
    weight (default 1; 0: the node owns nothing and only forwards)."""
    names = list(nodes)
    w = [max(0, (weights or {}).get(n, 1)) for n in names]
    total = sum(w)
    if total == 0:
        raise ValueError("at least one node must own slots (every weight is 0)")
    owners: list[str] = []
    acc = 0
    for name, weight in zip(names, w):
        acc += weight
        owners += [name] * (slots * acc // total - len(owners))
    return tuple(owners)


def static_map(nodes: Iterable[str], weights: Mapping[str, int] | None = None,
               slots: int = DEFAULT_SLOTS, **extra) -> SlotMap:
    names = tuple(nodes)
    return SlotMap(spread(names, weights, slots), frozenset(names), **extra)


# ---------------------------------------------------------------------- owning keys


@dataclass(frozen=True)
class Target:
    """An address as the owning-key rules read it."""
    key: str                  # the owning key (hashed to a slot)
    exchange: str | None      # the exchange, for exchange addresses
    routing_key: str | None   # the key given with it (None: none)
    wildcard: bool = False    # a binding key with `*` / `#` on a topic exchange


def owning_key(address: str, *, topic: bool, exchanges: Mapping[str, str],
               pinned: frozenset[str] = frozenset()) -> Target:
    """Normalise an address the way core/addresses.resolve does, so that a topic named
    by capability (`orders` + `topic`) and by path (`amq.topic/orders`) have one key.
    `exchanges`: every exchange's name → type (the same on every node: configured).
    A queue named like an exchange, or a queue reached with the `topic` capability,
    is read as the exchange / topic here (a cluster cannot ask every node first)."""
    head, key = split_address(address)
    if key is not None and head in exchanges:
        return _exchange_target(head, key, exchanges[head], pinned)
    if key is None and address in exchanges:
        return _exchange_target(address, None, exchanges[address], pinned)
    if topic and not address.startswith((TEMP_PREFIX, RESERVED_PREFIX)):
        return _exchange_target(TOPIC_EXCHANGE, address, exchanges.get(TOPIC_EXCHANGE, TOPIC), pinned)
    return Target(address, None, None)


def _exchange_target(exchange: str, key: str | None, kind: str, pinned: frozenset[str]) -> Target:
    if kind == FANOUT or exchange in pinned:
        return Target(exchange, exchange, key)
    if key is None:
        return Target(exchange, exchange, None)
    wildcard = kind == TOPIC and any(w in ("*", "#") for w in key.split("."))
    return Target(f"{exchange}/{key}", exchange, key, wildcard)


def partitioned_keys(declared: Iterable[tuple[str, bool, int]], *, exchanges: Mapping[str, str],
                     pinned: frozenset[str] = frozenset()) -> dict[str, int]:
    """The owning key → member count of each `[[cluster.partitioned]]` (address, topic,
    members).  ValueError for a declaration that is valid syntax but cannot mean one
    partitioned destination: a topic pattern (`*`, `#`: many topics, and a member is one);
    a whole exchange (fanout, pinned, or no key: owned by one node by definition); one
    destination declared twice (which count was meant?); or a name that is a member name
    of another (`orders.p1` beside `orders`: member 1 of it, and `orders.p7` would be
    read as a member `orders` no longer has, whose messages go to member 0)."""
    found: dict[str, int] = {}
    for address, topic, members in declared:
        t = owning_key(address, topic=topic, exchanges=exchanges, pinned=pinned)
        if t.wildcard:
            raise ValueError(f"partitioned '{address}': a topic pattern (* or #), not one topic")
        if t.exchange is not None and t.key == t.exchange:
            raise ValueError(f"partitioned '{address}': the whole exchange '{t.exchange}', which one node "
                             "owns (a fanout or pinned exchange, or no routing key)")
        if t.key in found:
            raise ValueError(f"partitioned '{address}' is declared twice ({found[t.key]} and {members} members)")
        found[t.key] = members
    for key in found:
        named = member_name(key)
        if named and named[0] in found:
            raise ValueError(f"partitioned '{key}' is named as a member of partitioned '{named[0]}' "
                             f"({named[0]}.p0, {named[0]}.p1, …): choose another name")
    return found


def client_home(container_id: str, slots: SlotMap) -> str:
    """The node that grants a client-id (JMS clientID, the AMQP container-id) to one
    connection at a time across the cluster (`sole-connection-for-container`)."""
    return slots.owner(f"$client-id/{container_id}")


def temp_address(kind: str, node: str, unique: str) -> str:
    """A temporary node's address names the node that holds it."""
    return f"{TEMP_PREFIX}{kind}.{node}.{unique}"


def temp_node(address: str) -> str | None:
    """The node named in a temporary address (None: a single broker's, without one)."""
    if not address.startswith(TEMP_PREFIX):
        return None
    parts = address[len(TEMP_PREFIX):].split(".")
    return parts[1] if len(parts) == 3 else None


# ---------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class LinkShape:
    """What `place_link` reads of an attach (plain values from the terminus)."""
    consumer: bool                     # the broker sends (a receiver on the client)
    address: str | None = None
    topic: bool = False                # the terminus has the `topic` capability
    dynamic: bool = False
    null_source: bool = False          # a receiver whose source is null (unsubscribe)
    coordinator: bool = False


def place_link(link: LinkShape, here: str, slots: SlotMap, exchanges: Mapping[str, str]) -> Placement:
    """The attach row of the table in the module docstring."""
    if link.coordinator or link.dynamic:
        return LOCAL
    if link.consumer and link.null_source:
        return Scatter(tuple(n for n in slots.nodes if n != here and slots.available(n)))
    address = link.address
    if not address:
        if link.consumer:
            return LOCAL   # refused by the node itself (no address), as alone
        return PER_MESSAGE
    return _place_address(address, link.topic, link.consumer, here, slots, exchanges)


def place_message(to: str | None, topic: bool, here: str, slots: SlotMap,
                  exchanges: Mapping[str, str], subject: str | None = None,
                  exchange: str | None = None) -> Placement:
    """A message of a per-message producer: its `to` (anonymous relay; `topic` from
    x-opt-jms-dest), or its `subject` as the key on `exchange` (a producer that named
    an exchange without a key)."""
    if exchange is not None:
        # The single broker's rule (core/broker.py `route`): the key is the subject,
        # "" when there is none.
        return _place_address(f"{exchange}/{subject or ''}", False, False, here, slots, exchanges)
    if not to:
        return LOCAL   # refused by the node itself (no `to`), as alone
    return _place_address(to, topic, False, here, slots, exchanges)


SUBSCRIPTION_QUEUE_PREFIX = "qpidsub_/"   # core/subscriptions.py SubscriptionKey.queue_name


def queue_members(address: str, here: str, slots: SlotMap,
                  exchanges: Mapping[str, str]) -> tuple[tuple[str, str], ...] | None:
    """Where the queue(s) a reader of `address` reads live, as (queue, node) pairs: its
    owner, or each member of a partitioned queue; None when any node may hold it (a
    subscription's queue lives beside its topic, and on each member of a partitioned
    topic: ask every node).  Raises LookupError when it can go nowhere (wildcards)."""
    if address.startswith(SUBSCRIPTION_QUEUE_PREFIX):
        return None
    placed = _place_address(address, False, True, here, slots, exchanges)
    if isinstance(placed, Local):
        return ((address, here),)
    if isinstance(placed, Forward):
        return ((address, placed.node),)
    if isinstance(placed, Partitioned):
        return placed.members
    if isinstance(placed, Refuse) and placed.condition == UNAVAILABLE:
        return ((address, slots.owner(owning_key(address, topic=False, exchanges=exchanges,
                                                 pinned=slots.pinned).key)),)
    raise LookupError(getattr(placed, "description", f"no queue for '{address}'"))


def _place_address(address: str, topic: bool, consumer: bool, here: str, slots: SlotMap,
                   exchanges: Mapping[str, str]) -> Placement:
    if address.startswith((RESERVED_PREFIX, SUBSCRIPTION_QUEUE_PREFIX)):
        # Controls are the node's own; a subscription's queue named directly lives
        # beside its topic (on each member's node for a partitioned one), not at the
        # hash of its name: served where the client is (queue_members says where).
        return LOCAL
    node = temp_node(address)
    if node is not None:
        return _at(node, address, here, slots)
    target = owning_key(address, topic=topic, exchanges=exchanges, pinned=slots.pinned)
    if slots.partitioned:
        members = slots.partitioned.get(target.key)
        if members:
            return Partitioned(target.key, partition_members(target.key, members, slots))
        members_at = member_node(target.key, slots)
        if members_at is not None:
            return _at(members_at, target.key, here, slots)
        if not consumer and former_member(target.key, slots) is not None:
            # A member name its destination does not have (`orders.p2` of `orders` over
            # 2): such a queue is a member dropped from the configuration, and what it
            # holds is shovelled into member 0, so a message sent to it would never
            # reach a consumer of that name.  A consumer may still read what is left
            # (a reader of the dropped member that has not moved on yet).
            base = member_name(target.key)[0]
            return Refuse(NOT_FOUND, f"'{address}' is not a member of partitioned '{base}' "
                                     f"({slots.partitioned[base]} members): use '{base}'")
    if target.exchange is not None and target.routing_key is None and not consumer \
            and exchanges.get(target.exchange) != FANOUT and target.exchange not in slots.pinned:
        return PER_MESSAGE   # the key is each message's subject
    if target.exchange is not None and target.routing_key is None and consumer \
            and exchanges.get(target.exchange) == TOPIC and target.exchange not in slots.pinned:
        target = Target(target.key, target.exchange, "#", True)   # Exchange.default_key
    if target.wildcard and consumer:
        return Refuse(NOT_IMPLEMENTED,
                      f"wildcard binding key '{target.routing_key}' on exchange '{target.exchange}': its "
                      f"topics are spread over the cluster's nodes (pin the exchange to allow wildcards)")
    return _at(slots.owner(target.key), target.key, here, slots)


def _at(node: str, key: str, here: str, slots: SlotMap) -> Placement:
    if node == here:
        return LOCAL
    if not slots.available(node):
        return Refuse(UNAVAILABLE, f"'{key}' is held by node {node}, which is not available now")
    return Forward(node, key)


def partition_members(address: str, count: int, slots: SlotMap) -> tuple[tuple[str, str], ...]:
    """Member i of a partitioned destination: `<key>.p<i>` (a normal destination),
    owned by consecutive nodes starting from the address's own slot owner, so K ≤ N
    members sit on K different nodes."""
    nodes = [n for n in slots.nodes if n in set(slots.owners)]
    start = nodes.index(slots.owner(address))
    return tuple((member_address(address, i), nodes[(start + i) % len(nodes)]) for i in range(count))


def member_address(key: str, index: int) -> str:
    """A member's address: `orders.p0` for a queue, `amq.topic/prices.p0` for a topic."""
    return f"{key}.p{index}"


def member_name(address: str) -> tuple[str, int] | None:
    """(destination, index) of a name of a member's form (`orders.p2` → (`orders`, 2)),
    whether or not the map has that member; None for any other name.  The index is
    ASCII digits only (core/numbers.py)."""
    base, dot, suffix = address.rpartition(".p")
    index = ascii_int(suffix) if dot else None
    return None if index is None else (base, index)


def member_base(address: str, slots: SlotMap) -> str | None:
    """The partitioned destination whose member `address` is (`amq.topic/prices.p1` →
    `amq.topic/prices`), or None."""
    named = member_name(address)
    return named[0] if named and named[1] < slots.partitioned.get(named[0], 0) else None


def former_member(address: str, slots: SlotMap) -> tuple[str, str] | None:
    """A member that its partitioned destination no longer has (`prices.p2` of `prices`
    now over 2 members): (member 0's address, its node), where what is left in it goes,
    or None.  A destination no longer partitioned at all cannot be told from one named
    so (docs/cluster.md, "Not done yet")."""
    named = member_name(address)
    count = slots.partitioned.get(named[0]) if named else None
    if not count or named[1] < count:
        return None
    return partition_members(named[0], count, slots)[0]


def former_plain(address: str, slots: SlotMap, formerly: Mapping[str, int]) -> str | None:
    """The destination a member name belonged to while it was partitioned, now that
    it is plain (`orders.p1` of `orders`, partitioned over 2 before and not at all now):
    what is left in the member goes there.  `formerly`: the destinations this node's
    store knows were partitioned and are no longer (`partition_history`), so a plain
    destination that happens to be named like a member is never taken for one; None
    for any other name."""
    named = member_name(address)
    if named is None or named[0] in slots.partitioned or named[1] >= formerly.get(named[0], 0):
        return None
    return named[0]


def partition_history(stored: Mapping[str, int], slots: SlotMap,
                      held: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(formerly, to store) from the partitioned destinations this node's store was
    last started with (`stored`: owning key → member count), today's, and the names it
    holds (queues, subscriptions' bindings as addresses).  `formerly`: those partitioned
    then and plain now; stored again: today's, and each former one while this node
    still holds a name of one of its members (its merge is not over: a crash, or a
    queue emptied by its shovel but not deleted).  A destination partitioned again
    with fewer members keeps the larger count until its dropped members are gone."""
    formerly = {key: count for key, count in stored.items() if key not in slots.partitioned}
    history = dict(slots.partitioned)
    for named in filter(None, map(member_name, held)):
        base, index = named
        if index < stored.get(base, 0) and index >= history.get(base, 0):   # a member not (yet) merged
            history[base] = stored[base]
    return formerly, history


def member_node(key: str, slots: SlotMap) -> str | None:
    """The node of a member address named directly (`orders.p1`): its member's node,
    never its own hash, so every way to a member leads to the same node."""
    named = member_name(key)
    count = slots.partitioned.get(named[0]) if named else None
    if not count or named[1] >= count:
        return None
    return partition_members(named[0], count, slots)[named[1]][1]


def destination_of(address: str, topic: bool, slots: SlotMap, exchanges: Mapping[str, str]) -> str:
    """One name for the destination an address reaches, however it is spelled
    (`prices` + `topic`, `amq.topic/prices`, `amq.topic` alone = its key `#`), a
    member of a partitioned destination named as the destination: what a durable
    subscription's binding and a client's attach are compared by (`replaces`)."""
    t = owning_key(address, topic=topic, exchanges=exchanges, pinned=slots.pinned)
    if t.exchange is None:
        name = t.key
    elif t.routing_key:
        name = f"{t.exchange}/{t.routing_key}"
    elif t.routing_key is None and exchanges.get(t.exchange) == TOPIC:
        name = f"{t.exchange}/#"   # Exchange.default_key
    else:
        name = t.exchange
    return member_base(name, slots) or name


def replaces(held: tuple[str, bool], attached: tuple[str, bool], slots: SlotMap,
             exchanges: Mapping[str, str]) -> bool:
    """Whether a client's durable subscription attach (`attached`: its address and
    topic capability) replaces the subscription of that name another node holds
    (`held`: the address it is bound by): JMS 2.0 §6.11, the same name under another
    topic replaces it.  The same destination is never replaced there: that node is not
    the destination's, so only an unfinished change of the map left it there
    (cluster/moves.py), and deleting it would delete the backlog the client came for."""
    return destination_of(*held, slots, exchanges) != destination_of(*attached, slots, exchanges)


# ---------------------------------------------------------------------- after a change of the map


@dataclass(frozen=True)
class HeldSubscription:
    """A durable subscription in a node's store, as `misplaced_subscriptions` reads it."""
    name: str
    topic: str          # its binding as an address: `amq.topic/prices`
    owner: str = ""     # misplaced: the node (or members) that owns the topic now
    queue: str = ""     # its queue's name (unique on a node; the name is per client-id)
    node: str = ""      # misplaced: the one node it can move to ("" for a partitioned topic)
    members: tuple[tuple[str, str], ...] = ()   # misplaced, its topic partitioned: (address, node) each


def misplaced_subscriptions(held: Iterable[HeldSubscription], here: str, slots: SlotMap,
                            exchanges: Mapping[str, str],
                            formerly: Mapping[str, int] | None = None) -> list[HeldSubscription]:
    """The durable subscriptions held `here` whose topic another node owns under `slots`
    (every node counted as up: ownership, not liveness).  Only a change of the map puts
    one there (another `--workers` count or weights, other pinned or partitioned
    exchanges): a subscription lives beside its topic.  Left alone, its topic's messages
    go to the owner, where it does not exist, and attaching it again there would delete
    it here (cluster/guard.py, JMS 2.0 §6.11), backlog and all.  One whose topic has one
    owner (`node`) is moved there, one whose topic became partitioned to every member
    (`members`), and a copy on a member its topic no longer has into member 0's copy,
    before any node serves a client (cluster/moves.py, `--workers` or behind a remap's
    gate); otherwise the node must not start (cluster/node.py).  A copy on a member of
    a topic that is plain again (`formerly`, `former_plain`) cannot move (its members'
    copies are not merged: docs/cluster.md "Not done yet"): the node must not start, so
    that no attach on the plain topic replaces it, backlog and all."""
    every = slots.with_live(slots.nodes)
    out = []
    for sub in held:
        base = former_plain(sub.topic, every, formerly or {})
        if base is not None:
            out.append(HeldSubscription(sub.name, sub.topic, f"nobody: {base} is no longer partitioned, and its "
                                                             f"members' copies are not merged", sub.queue))
            continue
        former = former_member(sub.topic, every)
        if former is not None:   # its member is no more: what it holds goes to member 0's copy
            out.append(HeldSubscription(sub.name, sub.topic, f"member {former[0]} on {former[1]}", sub.queue,
                                        members=(former,)))
            continue
        placed = place_link(LinkShape(consumer=True, address=sub.topic), here, every, exchanges)
        if isinstance(placed, Forward) and placed.node != here:
            out.append(HeldSubscription(sub.name, sub.topic, placed.node, sub.queue, placed.node))
        elif isinstance(placed, Partitioned):
            out.append(HeldSubscription(sub.name, sub.topic,
                                        "members " + ", ".join(f"{a} on {n}" for a, n in placed.members),
                                        sub.queue, members=tuple(placed.members)))
    return out


def movable(sub: HeldSubscription, here: str) -> bool:
    """Whether a misplaced subscription can move (cluster/moves.py): to its topic's node,
    or to the members of its topic, now partitioned, one of them elsewhere (its backlog
    goes there, and a copy is made on each)."""
    return bool(sub.node) or any(node != here for _, node in sub.members)


class MisplacedSubscriptions(Exception):
    """A node's store holds durable subscriptions that another node owns now."""

    def __init__(self, node: str, found: list[HeldSubscription]):
        shown = "; ".join(f"'{s.name}' (topic {s.topic}, owned by {s.owner})" for s in found[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        super().__init__(
            f"node {node} holds {len(found)} durable subscription(s) whose topic another node owns under "
            f"this slot map: {shown}{more}.  The map changed since they were made (--workers or "
            f"--worker-weights, or [cluster] pinned / partitioned); a subscription moves with its topic only "
            f"while `serve --workers` starts or behind the gate of a `cluster remap`, and attaching one again would delete it here with its messages.  "
            f"Start with the map they were made under, or receive and unsubscribe them there first")
        self.found = found
