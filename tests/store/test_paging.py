"""The paged region of durable queues, through DurabilityManager on a real LmdbStore.

Beyond its memory budget a durable queue keeps new persistent entries only in the
store (after `page_cursor`), counts them in `paged_count`, and reads them back in
sequence order when its in-memory window runs low.  A real LMDB environment in
tmp_path and a real asyncio loop (store callbacks run on it), no mocks.
"""

from __future__ import annotations

import asyncio

import pytest

from amqpbroker.core.broker import Broker
from amqpbroker.core import queues
from amqpbroker.core.queues import Outcome, Queue
from amqpbroker.core.registry import SubscriptionRegistry
from amqpbroker.store.durability import DurabilityManager
from amqpbroker.store.lmdb_store import LmdbStore
from tests.core.helpers import RecordingConsumer, bodies, make_message


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(autouse=True)
def small_window(monkeypatch):
    monkeypatch.setattr(queues, "PAGE_IN_LOW", 3)     # read by Queue.__init__
    monkeypatch.setattr(queues, "PAGE_IN_BATCH", 4)


def msg_size(body: str = "m00") -> int:
    return make_message(body, durable=True).size


class Rig:
    """A broker + DurabilityManager on an LmdbStore, started like BrokerServer.start."""

    def __init__(self, path, loop, budget):
        self.loop = loop
        self.store = LmdbStore(path)
        self.broker = Broker()
        self.registry = SubscriptionRegistry(self.broker, lambda sel, nl: None)
        self.dm = DurabilityManager(self.broker, self.registry, self.store, memory_budget=budget)
        self.dm.recover(self.store.open(loop), lambda sel, nl: None)
        self.dm.install()

    def commit(self, timeout: float = 20.0):
        """Run the loop until everything queued so far is committed and its callbacks ran."""
        fut = self.loop.create_future()
        self.store.after_commit(lambda err: fut.set_result(err))
        return self.loop.run_until_complete(asyncio.wait_for(fut, timeout))

    def close(self):
        self.commit()
        self.store.close()

    def count(self, queue: Queue) -> int:
        return self.store.count_entries(queue.store_id)


@pytest.fixture
def rig(tmp_path, loop):
    rigs: list[Rig] = []

    def make(budget: int):
        r = Rig(tmp_path / "store", loop, budget)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        if r.store.env is not None:
            r.store.close()


def fill(queue: Queue, n: int, start: int = 0, **fields):
    return [queue.enqueue(make_message(f"m{i:02d}", durable=True, **fields)) for i in range(start, start + n)]




def drain(queue: Queue, n: int) -> list:
    c = RecordingConsumer(credit=n)
    queue.add_consumer(c)
    got = bodies(c.delivered)
    for entry in list(c.delivered):
        queue.settle(entry, Outcome.ACCEPTED)
    queue.remove_consumer(c, [], failed=False)
    return got


# ---------------------------------------------------------------------- paging out


def test_beyond_the_budget_entries_live_only_in_the_store(rig):
    r = rig(budget=5 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 20)
    assert q.ready_count == 20 and q.depth == 20
    assert len(q._ready) == 5 and q.paged_count == 15 and len(q._pending_page) == 15
    r.commit()
    assert q._pending_page == {}              # committed: gone from memory
    assert len(q._ready) == 5 and q.paged_count == 15 and q.depth == 20
    assert q.paged_bytes == 15 * msg_size() and q.bytes == 20 * msg_size()
    assert q.mem_bytes == 5 * msg_size()
    assert q.page_cursor == 5
    assert r.count(q) == 20


def test_once_paging_every_persistent_entry_is_paged_but_non_persistent_ones_stay(rig, monkeypatch):
    monkeypatch.setattr(queues, "PAGE_IN_LOW", 1)
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 4)
    q.enqueue(make_message("transient", durable=False))
    assert q.paged_count == 2 and len(q._ready) == 3
    r.commit()
    # The transient message overtakes the paged durable ones (documented).
    assert drain(q, 10) == ["m00", "m01", "transient", "m02", "m03"]


def test_page_in_delivers_the_backlog_in_sequence_order_and_empties_the_store(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 30)
    r.commit()
    assert drain(q, 100) == [f"m{i:02d}" for i in range(30)]
    assert q.depth == 0 and q.paged_count == 0 and q.paged_bytes == 0 and q.bytes == 0
    r.commit()
    assert r.count(q) == 0


def test_page_in_is_by_sequence_whatever_the_priority(rig):
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    for i, p in enumerate([4, 4, 1, 9, 1, 9, 4, 4, 4, 4, 4, 9]):
        q.enqueue(make_message(f"m{i:02d}", durable=True, priority=p))
    r.commit()
    order = drain(q, 100)
    assert sorted(order) == [f"m{i:02d}" for i in range(12)]
    # Priorities apply within the in-memory window only: the priority-9 message deep
    # in the paged region waits for its window, after priority-4 ones before it.
    assert order.index("m11") > order.index("m09") > order.index("m00")
    assert order.index("m03") < order.index("m00")   # in the same window: first


def test_a_consumer_gets_the_pending_entries_before_their_commit(rig):
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    pending = dict(q._pending_page)
    c = RecordingConsumer(credit=100)
    q.add_consumer(c)                           # nothing committed yet: taken from memory
    assert bodies(c.delivered) == [f"m{i:02d}" for i in range(10)]
    assert all(e is pending[e.seq] for e in c.delivered[2:])
    assert q.paged_count == 0 and q._pending_page == {}
    for e in list(c.delivered):
        q.settle(e, Outcome.ACCEPTED)
    r.commit()                                  # the late commit callbacks change nothing
    assert q.depth == 0 and r.count(q) == 0


def test_committed_entries_whose_callback_has_not_run_are_taken_from_memory(rig):
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()                                  # seqs 3..10: in the store only
    fill(q, 5, start=10)
    r.store.flush()                             # 11..15 on disk, the loop has not run the callbacks
    assert r.count(q) == 15 and len(q._pending_page) == 5 and q.paged_count == 13
    pending = dict(q._pending_page)
    c = RecordingConsumer(credit=100)
    q.add_consumer(c)
    assert bodies(c.delivered) == [f"m{i:02d}" for i in range(15)]
    assert all(e is pending[e.seq] for e in c.delivered[10:])   # not read again
    assert q.paged_count == 0 and q._pending_page == {}
    r.commit()
    assert q.paged_count == 0 and q._pending_page == {}


def test_new_messages_stop_being_paged_once_the_region_is_empty(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 8)
    r.commit()
    assert drain(q, 100) == [f"m{i:02d}" for i in range(8)]
    fill(q, 2, start=8)
    assert q.paged_count == 0 and len(q._ready) == 2
    fill(q, 4, start=10)                        # over the budget again: a new region
    r.commit()
    assert q.paged_count == 3 and q.page_cursor == q._ready._levels[4][-1].seq
    assert drain(q, 100) == [f"m{i:02d}" for i in range(8, 14)]


# ---------------------------------------------------------------------- removal


def test_purge_of_a_paged_queue_removes_store_entries_and_messages(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 20)
    mids = [e.store_ref for e in entries]
    r.commit()
    fill(q, 5, start=20)                        # and some still pending
    assert q.purge() == 25
    assert q.depth == 0 and q.paged_count == 0 and q.bytes == 0 and q._pending_page == {}
    r.commit()
    assert r.count(q) == 0
    assert all(r.store.read_message(mid) is None for mid in mids)
    fill(q, 2, start=30)                        # the queue works on afterwards
    r.commit()
    assert drain(q, 10) == ["m30", "m31"]


def test_fan_out_references_survive_purging_one_paged_queue(rig):
    r = rig(budget=2 * msg_size())
    a = r.broker.declare_queue("a", durable=True)
    b = r.broker.declare_queue("b", durable=True)
    msgs = [make_message(f"m{i:02d}", durable=True) for i in range(6)]
    for m in msgs:
        a.enqueue(m)
        b.enqueue(m)
    r.commit()
    assert a.paged_count == 4 and b.paged_count == 4
    assert all(r.dm.refs[m.store_id] == 2 for m in msgs)
    mids = [m.store_id for m in msgs]
    assert a.purge() == 6
    r.commit()
    assert r.dm.refs == {}
    assert all(r.store.read_message(mid) is not None for mid in mids)
    assert drain(b, 10) == [f"m{i:02d}" for i in range(6)]
    r.commit()
    assert all(r.store.read_message(mid) is None for mid in mids)


def test_deleting_a_paged_queue_releases_its_references(rig):
    r = rig(budget=2 * msg_size())
    a = r.broker.declare_queue("a", durable=True)
    b = r.broker.declare_queue("b", durable=True)
    msgs = [make_message(f"m{i:02d}", durable=True) for i in range(6)]
    for m in msgs:
        a.enqueue(m)
        b.enqueue(m)
    r.commit()
    r.broker.delete_queue("a")
    r.commit()
    assert r.dm.refs == {}
    assert drain(b, 10) == [f"m{i:02d}" for i in range(6)]
    r.commit()
    assert all(r.store.read_message(m.store_id) is None for m in msgs if m.store_id is not None)


def test_remove_below_reaches_into_the_paged_region(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 20)
    r.commit()
    fill(q, 2, start=20)                        # pending: seqs 21, 22
    assert q.remove_below(11) == 10
    assert q.depth == 12 and q.paged_count == 12 and q.page_cursor == 10 and q.acked_total == 10
    assert q.remove_below(22) == 11
    assert q.depth == 1 and q.paged_count == 1
    r.commit()
    assert r.count(q) == 1
    assert drain(q, 10) == ["m21"]


def test_paged_entries_expire_when_paged_in(rig):
    r = rig(budget=2 * msg_size("m00"))
    q = r.broker.declare_queue("q", durable=True)
    now = [1000.0]
    q.clock = lambda: now[0]
    fill(q, 2)
    fill(q, 3, start=2, ttl=10)                 # paged, expire at 1000 + 10 (proton: ms? s)
    fill(q, 2, start=5)
    r.commit()
    assert q.paged_count == 5
    now[0] = 10**12
    assert drain(q, 100) == ["m00", "m01", "m05", "m06"]
    assert q.expired_total == 3 and q.depth == 0
    r.commit()
    assert r.count(q) == 0


def test_lost_pending_entries_are_discarded(rig):
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 5)
    lost = {e.seq for e in entries[3:]}
    assert q.discard(lost) == 2
    assert q.paged_count == 1 and q.depth == 3
    r.commit()
    assert drain(q, 10) == ["m00", "m01", "m02"]


# ---------------------------------------------------------------------- restart


def test_restart_with_a_paged_backlog_delivers_everything_once_in_order(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 25)
    r.close()
    r2 = rig(budget=3 * msg_size())
    q2 = r2.broker.queues["q"]
    assert r2.dm.recovered_messages == 25
    assert len(q2._ready) == 4                   # the recovery window: page_in_batch entries
    assert q2.paged_count == 21 and q2.depth == 25 and q2.page_cursor == 4
    assert q2.bytes == 25 * msg_size() and q2.paged_bytes == 21 * msg_size()
    q2.enqueue(make_message("late", durable=True))   # joins the paged region
    assert q2.paged_count == 22
    r2.commit()
    assert drain(q2, 100) == [f"m{i:02d}" for i in range(25)] + ["late"]
    r2.close()
    r3 = rig(budget=3 * msg_size())
    assert r3.broker.queues["q"].depth == 0 and r3.dm.recovered_messages == 0


def test_restart_counts_references_and_redeliveries_in_the_paged_region(rig):
    r = rig(budget=2 * msg_size())
    a = r.broker.declare_queue("a", durable=True)
    b = r.broker.declare_queue("b", durable=True)
    msgs = [make_message(f"m{i:02d}", durable=True) for i in range(10)]
    for i, m in enumerate(msgs):
        a.enqueue(m)
        if i % 2:
            b.enqueue(m)
    r.commit()
    # A delivered-but-unsettled entry deep in the region (as a crash would leave it).
    rec = r.store.read_entries(a.store_id, 8, 1)[0]
    rec.delivered = True
    r.store.update_entry(a.store_id, rec)
    r.close()
    r2 = rig(budget=2 * msg_size())
    a2, b2 = r2.broker.queues["a"], r2.broker.queues["b"]
    assert a2.paged_count == 6 and b2.paged_count == 1
    assert r2.dm.refs == {m.store_id: 2 for i, m in enumerate(msgs) if i % 2}
    assert r2.dm.redelivered == 1
    c = RecordingConsumer(credit=100)
    a2.add_consumer(c)
    assert bodies(c.delivered) == [f"m{i:02d}" for i in range(10)]
    assert [e.delivery_count for e in c.delivered] == [0] * 8 + [1, 0]
    a2.purge()
    for e in list(c.delivered):
        a2.settle(e, Outcome.ACCEPTED)
    r2.commit()
    assert r2.dm.refs == {}
    assert drain(b2, 100) == [f"m{i:02d}" for i in range(1, 10, 2)]
    r2.commit()
    assert all(r2.store.read_message(m.store_id) is None for m in msgs)


def test_release_map_unmaps_the_store(rig):
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()
    assert r.store.release_map() > 0
    assert drain(q, 100) == [f"m{i:02d}" for i in range(10)]   # still readable
