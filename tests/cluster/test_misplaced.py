"""Which queues a node's shovel takes to another node (cluster/shovel.py
`misplaced_owner`): a member of a partitioned queue lives on its member's node, not
at the hash of its name, and must never be shovelled away from it."""

from __future__ import annotations

import pytest

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


# ---------------------------------------------------------------------- a partitioned destination made plain again

from amqpbroker.cluster.shovel import misplaced_target  # noqa: E402
from amqpbroker.core.placement import (HeldSubscription, former_plain, misplaced_subscriptions,  # noqa: E402
                                       movable, partition_history)

PLAIN = static_map(["n0", "n1"])
FORMERLY = {"orders": 2, "amq.topic/prices": 2}


def owner_of(key: str) -> str:
    return PLAIN.owners[slot_of(key, PLAIN.slots)]


@pytest.mark.parametrize("address, formerly, want", [
    ("orders.p1", FORMERLY, "orders"),
    ("amq.topic/prices.p0", FORMERLY, "amq.topic/prices"),
    ("orders.p2", FORMERLY, None),              # it never had a third member: a plain queue of that name
    ("orders.p1", {}, None),                    # never partitioned here: a plain queue that looks like one
    ("sensor.p1", FORMERLY, None),
    ("orders", FORMERLY, None),
])
def test_a_former_member_is_known_only_from_what_the_store_recorded(address, formerly, want):
    assert former_plain(address, PLAIN, formerly) == want


def test_a_destination_partitioned_again_is_not_plain():
    again = SlotMap(PLAIN.owners, PLAIN.live, partitioned={"orders": 2})
    assert former_plain("orders.p1", again, FORMERLY) is None


@pytest.mark.parametrize("stored, partitioned, held, formerly, kept", [
    ({}, {"orders": 2}, [], {}, {"orders": 2}),                              # first start partitioned
    ({"orders": 2}, {}, ["orders.p1"], {"orders": 2}, {"orders": 2}),        # plain now, a member still here
    ({"orders": 2}, {}, ["orders"], {"orders": 2}, {}),                      # merged: forgotten
    ({"orders": 2}, {"orders": 3}, ["orders.p1"], {}, {"orders": 3}),        # partitioned again
    ({"orders": 3}, {"orders": 2}, ["orders.p2"], {}, {"orders": 3}),        # fewer: p2 not yet in p0
    ({"orders": 3}, {"orders": 2}, ["orders.p1"], {}, {"orders": 2}),
    ({"orders": 2, "x": 2}, {}, ["amq.topic/x.p0"], {"orders": 2, "x": 2}, {}),   # x is a queue's key
])
def test_the_history_keeps_a_former_destination_while_a_member_of_it_is_held(stored, partitioned, held,
                                                                             formerly, kept):
    slots = SlotMap(PLAIN.owners, PLAIN.live, partitioned=partitioned)
    assert partition_history(stored, slots, held) == (formerly, kept)


def test_a_former_member_queue_goes_into_the_plain_queue_at_its_owner_even_this_node():
    owner = owner_of("orders")
    other = next(n for n in ("n0", "n1") if n != owner)
    assert misplaced_target("orders.p1", other, PLAIN, EXCHANGES, FORMERLY) == (owner, "orders")
    assert misplaced_target("orders.p1", owner, PLAIN, EXCHANGES, FORMERLY) == (owner, "orders")
    assert misplaced_target("orders.p1", owner_of("orders.p1"), PLAIN, EXCHANGES, {}) is None   # a plain queue


def test_a_former_members_subscription_copy_can_move_nowhere_so_the_node_refuses_to_start():
    copy = HeldSubscription("s", "amq.topic/prices.p1", queue="q")
    for here in ("n0", "n1"):
        found = misplaced_subscriptions([copy], here, PLAIN, EXCHANGES, FORMERLY)
        assert [(m.name, m.node, m.members) for m in found] == [("s", "", ())]
        assert "amq.topic/prices is no longer partitioned" in found[0].owner
        assert not movable(found[0], here)
    unknown = misplaced_subscriptions([copy], "n0", PLAIN, EXCHANGES, {})   # no record: a topic of that name
    assert all("no longer partitioned" not in m.owner for m in unknown)


def test_a_plain_queue_made_partitioned_goes_into_its_member_0():
    slots = SlotMap(PLAIN.owners, PLAIN.live, partitioned={"orders": 2})
    address, node = partition_members("orders", 2, slots)[0]
    assert address == "orders.p0"
    for here in ("n0", "n1"):
        assert misplaced_target("orders", here, slots, EXCHANGES) == (node, "orders.p0")
    member_1 = partition_members("orders", 2, slots)[1][1]
    assert misplaced_target("orders.p1", member_1, slots, EXCHANGES) is None   # a member stays on its node
