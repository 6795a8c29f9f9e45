"""Which queues a node's shovel takes to another node (cluster/shovel.py
`misplaced_owner`): a member of a partitioned queue lives on its member's node, not
at the hash of its name, and must never be shovelled away from it."""

from __future__ import annotations

from amqpbroker.cluster.shovel import misplaced_owner
from amqpbroker.core.placement import SlotMap, partition_members, slot_of, static_map

EXCHANGES = {"amq.topic": "topic", "amq.direct": "direct", "amq.fanout": "fanout"}


def test_a_partition_member_is_never_misplaced_on_its_members_node():
    base = static_map(["n0", "n1", "n2"], {"n0": 0})
    # A partitioned name one of whose members hashes to another node than its own.
    for i in range(1000):
        key = f"log{i}"
        slots = SlotMap(base.owners, base.live, partitioned={key: 2})
        members = partition_members(key, 2, slots)
        odd = [(m, n) for m, n in members if base.owners[slot_of(m, base.slots)] != n]
        if odd:
            break
    member, node = odd[0]
    assert misplaced_owner(member, node, slots, EXCHANGES) is None
    other = next(n for n in ("n1", "n2") if n != node)
    assert misplaced_owner(member, other, slots, EXCHANGES) == node   # elsewhere: taken to its node


def test_an_ordinary_queue_is_misplaced_away_from_its_hash_owner():
    slots = static_map(["n0", "n1", "n2"], {"n0": 0})
    name = next(f"q{i}" for i in range(1000) if slots.owners[slot_of(f"q{i}", slots.slots)] == "n2")
    assert misplaced_owner(name, "n1", slots, EXCHANGES) == "n2"
    assert misplaced_owner(name, "n2", slots, EXCHANGES) is None
