"""Whether a client connection is handed to another worker of `serve --workers N`
(pure; the I/O is cluster/handoff.py, docs/cluster.md).

A connection may move, socket and all, only while nothing of it exists anywhere but in
the bytes this node read and wrote: the owner replays the client's bytes into its own
engine and must reach the state this node's engine had, and must write the very bytes
the client already got.  Each row of `RULES` is one reason to stay, checked in order;
none applies: the connection goes to the owner of its first link's address (for a
partitioned destination, the member's node `spread_owner` names).

The bytes: a connection's AMQP layer starts after its SASL layer, each a protocol
header and frames (AMQP 1.0 §2.2, §2.3, §5.3.1); an empty frame is a heartbeat
(§2.4.5), which a replay does not write again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
HANDOFF_MAX = 65536        # bytes of a connection recorded (each way) before its first attach
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class Candidate:
    """What is known of a client connection at one of its attaches."""
    recording: bool        # still recorded: its first attach, no more than HANDOFF_MAX bytes each way
    owner: str | None      # the node its link is forwarded to (core/placement.py Forward), or its
                           # partitioned destination's turn (spread_owner); None: here
    links: int             # links it has here (an info or refused link does not count)
    claims_elsewhere: bool  # it holds its client-id at another node (sole-connection-for-container)
    replayable: bool       # its recorded bytes parse (`amqp_start` both ways) and hold no heartbeat
    enabled: bool = True   # [cluster] handoff


STAY_RULES: tuple[tuple[str, Callable[[Candidate], bool]], ...] = (
    ("hand-off off", lambda c: not c.enabled),
    ("not its first attach", lambda c: not c.recording),
    ("its link is served here (or its turn of a partitioned destination is here)", lambda c: c.owner is None),
    ("it has links here", lambda c: c.links > 0),
    ("its client-id is held at another node", lambda c: c.claims_elsewhere),
    ("its bytes cannot be replayed", lambda c: not c.replayable),
)


def decide(c: Candidate) -> tuple[str | None, str]:
    """(the node to hand the connection to, or None to keep it; the reason)."""
    for why, applies in STAY_RULES:
        if applies(c):
            return None, why
    return c.owner, "its first link's address is another node's"


def spread_owner(member_nodes: tuple[str, ...], here: str, arrivals: int) -> str | None:
    """The node the `arrivals`-th connection (0-based, counted at this node for one
    partitioned destination and one link role) whose first link is on a partitioned
    destination is served at: round robin over its members' nodes, starting at this
    node's own member when it has one; None: here.  The kernel spreads a shared port's
    connections over the workers at random, so the members' nodes would otherwise get
    uneven shares of the producers and consumers, and the busiest bounds the whole
    (docs/cluster.md, "Through the one name").  Counting from the node's own member,
    each node keeps its first, hands its second on, and so on: any arrival pattern
    ends within one connection per node of even."""
    if not member_nodes:
        return None
    start = member_nodes.index(here) if here in member_nodes else 0
    node = member_nodes[(start + arrivals) % len(member_nodes)]
    return None if node == here else node


def amqp_start(data: bytes | bytearray, written: bool = False) -> int | None:
    """Where the AMQP layer starts in one direction of a connection (after SASL, if
    any): the offset of the AMQP protocol header, or None while not there yet.  SASL
    frames are skipped by their size (AMQP 1.0 §5.3.1, §2.3).  `written`: this node's
    output, which may hold nothing of the AMQP layer yet (nothing at all, or whole SASL
    frames only): then it starts at the end."""
    if data[:8] == AMQP_HEADER:
        return 0
    if data[:8] != SASL_HEADER:
        return 0 if written and not data else None
    pos = 8
    while len(data) >= pos + 8:
        if data[pos:pos + 8] == AMQP_HEADER:
            return pos
        size = _LEN.unpack_from(data, pos)[0]
        if size < 8:
            return None
        pos += size
    return pos if written and pos == len(data) else None


def has_empty_frame(data: bytes | bytearray) -> bool:
    """Whether AMQP output (from its header) holds an empty frame (a heartbeat, which
    a replay would not produce again), or a frame size that is not one.  A last frame
    cut short is fine: the owner checks its output against these bytes as they come."""
    pos = 8
    while len(data) >= pos + 4:
        size = _LEN.unpack_from(data, pos)[0]
        if size <= 8:
            return True   # a heartbeat, or not frames we understand: never hand off
        pos += size
    return False
