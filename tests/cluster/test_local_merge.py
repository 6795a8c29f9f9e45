"""cluster/unpartition.py LocalMerge on the real model and a real (non-persistent)
store: a member queue's messages moved into its plain queue a slice a loop turn, and
nothing moved while the store refuses writes (a copy's batch would fail while the
removal is kept: store/base.py write_refusal); a target nobody sent to yet made; and
cluster/shovel.py's rule for deleting a queue a change of partitioning left behind."""

from __future__ import annotations

import asyncio

from amqpbroker.cluster.shovel import Shovels
from amqpbroker.cluster.unpartition import LocalMerge
from amqpbroker.core.broker import Broker
from amqpbroker.store.base import Store, write_refusal
from tests.core.helpers import RecordingConsumer, bodies, make_message


class Side:
    """What LocalMerge needs of its node's shovels (cluster/shovel.py Shovels)."""

    def __init__(self, broker: Broker, store: Store, loop: asyncio.AbstractEventLoop):
        self.server = type("Server", (), {"broker": broker, "store": store, "loop": loop})()
        self.told: set[str] = set()
        self.ended: list[LocalMerge] = []

    def stopped(self, link: LocalMerge) -> None:
        self.ended.append(link)


def merge(full: bool, full_after: int | None = None) -> tuple[Broker, Side]:
    b = Broker()
    member = b.declare_queue("orders.p1")
    b.declare_queue("orders")
    for i in range(600):   # more than one slice (core/moves.py SLICE)
        b.publish(make_message(f"m{i}"), b.resolve("orders.p1"))
    store = Store()
    store.full = full

    async def run() -> Side:
        side = Side(b, store, asyncio.get_running_loop())
        LocalMerge(side, member, "orders").start()
        for turn in range(50):
            if turn == full_after:
                store.full = True   # the disk fills in the middle
            await asyncio.sleep(0)
        return side

    return b, asyncio.run(run())


def test_a_member_queue_is_moved_into_the_plain_queue_in_order():
    b, side = merge(full=False)
    assert b.queues["orders.p1"].depth == 0
    assert bodies(b.queues["orders"].entries()) == [f"m{i}" for i in range(600)]
    assert len(side.ended) == 1 and side.ended[0].moved == 600


def test_nothing_moves_while_the_store_refuses_writes():
    assert write_refusal(Store()) is None
    b, side = merge(full=True)
    assert b.queues["orders.p1"].depth == 600 and b.queues["orders"].depth == 0
    assert side.told == {"orders.p1"} and side.ended[0].moved == 0


def test_a_merge_stops_between_slices_once_the_store_refuses_and_keeps_what_moved():
    b, side = merge(full=False, full_after=1)
    moved = side.ended[0].moved
    assert 0 < moved < 600
    assert b.queues["orders"].depth == moved and b.queues["orders.p1"].depth == 600 - moved
    assert bodies(b.queues["orders"].entries()) == [f"m{i}" for i in range(moved)]


def test_a_merge_into_a_queue_nobody_has_sent_to_yet_makes_it():
    """Member 0 of a plain queue made partitioned, at the same node: never sent to (or
    deleted once emptied, cluster/shovel.py), it is made as the owner's attach would
    name it into being; the move of an explicit target alone would refuse it."""
    b = Broker()
    plain = b.declare_queue("orders")
    for i in range(3):
        b.publish(make_message(f"m{i}"), b.resolve("orders"))

    async def run() -> Side:
        side = Side(b, Store(), asyncio.get_running_loop())
        LocalMerge(side, plain, "orders.p0").start()
        for _ in range(5):
            await asyncio.sleep(0)
        return side

    side = asyncio.run(run())
    assert side.told == set(), side.told
    assert bodies(b.queues["orders.p0"].entries()) == ["m0", "m1", "m2"]
    assert b.queues["orders"].depth == 0


def leftovers(broker: Broker) -> Shovels:
    """A node's shovels knowing two misplaced queues: a member of a destination that
    is plain now (its messages go to `orders`) and a dead-letter queue another node
    owns (it keeps its name there)."""
    server = type("Server", (), {"broker": broker, "handlers_by_container": {}})()
    shovels = Shovels(server, type("Router", (), {"node": "n0"})())
    shovels.misplaced = {"orders.p1": ("n0", "orders"), "DLQ": ("n1", "DLQ")}
    return shovels


def test_a_queue_left_behind_is_deleted_only_once_empty_and_unread():
    b = Broker()
    member, dlq = b.declare_queue("orders.p1"), b.declare_queue("DLQ")
    shovels = leftovers(b)
    assert shovels._emptied_leftover("orders.p1", member)
    assert not shovels._emptied_leftover("DLQ", dlq), "a queue that keeps its name elsewhere is kept"
    b.publish(make_message("m"), b.resolve("orders.p1"))
    assert not shovels._emptied_leftover("orders.p1", member), "it holds a message"
    reader = RecordingConsumer(credit=0)
    member.add_consumer(reader)
    member.purge()
    assert not shovels._emptied_leftover("orders.p1", member), "a client reads it"
    member.remove_consumer(reader, [], failed=False)
    shovels.active["orders.p1"] = LocalMerge(shovels, member, "orders")
    assert not shovels._emptied_leftover("orders.p1", member), "its merge is running"
