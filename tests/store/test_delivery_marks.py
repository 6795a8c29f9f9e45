# ruff: noqa: F811  (the rig fixtures of test_paging.py, imported by name)
"""Delivered marks by range (store/marks.py) on a real store: hand-overs of entries
stored by earlier batches write the queue's delivery watermark, not a mark per entry;
recovery gives every entry up to it delivery-count+1 (in memory and in the paged
region) and drops it; a clean close with nothing acquired drops it too."""

from __future__ import annotations

import pytest

from amqpbroker.core.queues import Outcome
from amqpbroker.store.marks import LOOKAHEAD
from tests.core.helpers import RecordingConsumer, bodies
from tests.store.test_paging import fill, loop, msg_size, rig, small_window  # noqa: F401 (fixtures)


def test_hand_overs_of_a_stored_backlog_write_a_watermark_not_entry_marks(rig):
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 20)
    r.commit()
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    assert len(c.delivered) == 5 and r.dm.entry_marks == 0
    r.commit()
    assert r.store.read_watermark(q.store_id) == entries[-1].seq   # capped at the tail
    assert not any(rec.delivered for rec in r.store.read_entries(q.store_id, 0, 100))


def test_the_watermark_runs_ahead_of_the_deliveries_by_the_lookahead_at_most(rig):
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 10)
    r.commit()
    q.add_consumer(RecordingConsumer(credit=1))
    r.commit()
    assert r.store.read_watermark(q.store_id) == min(entries[0].seq + LOOKAHEAD, entries[-1].seq)


@pytest.mark.parametrize("budget", [0, 2])
def test_recovery_redelivers_everything_up_to_the_watermark_and_drops_it(rig, budget):
    r = rig(budget=budget * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 10)
    r.store.put_mark(q.store_id, entries[5].seq)   # as a crash would leave it
    r.commit()
    r.store.close()                                # no clean-close hook: dm saw no delivery
    r2 = rig(budget=budget * msg_size())
    q2 = r2.broker.queues["q"]
    assert r2.dm.redelivered == 6
    r2.commit()
    assert r2.store.read_watermark(q2.store_id) == 0   # spent: the fix-ups are written
    c = RecordingConsumer(credit=100)
    q2.add_consumer(c)
    assert bodies(c.delivered) == [f"m{i:02d}" for i in range(10)]
    assert [e.delivery_count for e in c.delivered] == [1] * 6 + [0] * 4


def test_page_in_before_the_fixups_commit_still_counts_them(rig):
    """Page-in reads committed records: until recovery's batch commits, entries up
    to the watermark read back need their delivery-count+1 all the same."""
    r = rig(budget=2 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 10)
    r.store.put_mark(q.store_id, entries[7].seq)
    r.commit()
    r.store.close()
    r2 = rig(budget=2 * msg_size())
    c = RecordingConsumer(credit=100)
    r2.broker.queues["q"].add_consumer(c)     # no commit yet: the fix-ups are on their way
    assert [e.delivery_count for e in c.delivered] == [1] * 8 + [0] * 2


def test_a_clean_close_with_nothing_acquired_drops_the_watermark(rig):
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()
    c = RecordingConsumer(credit=4)
    q.add_consumer(c)
    r.commit()
    assert r.store.read_watermark(q.store_id) > 0
    for e in list(c.delivered):
        q.settle(e, Outcome.ACCEPTED)
    r.close()
    r2 = rig(budget=0)
    assert r2.dm.redelivered == 0
    assert r2.store.read_watermark(r2.broker.queues["q"].store_id) == 0


def test_a_clean_close_with_deliveries_outstanding_keeps_it(rig):
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()
    q.add_consumer(RecordingConsumer(credit=4))   # never settled
    r.close()
    r2 = rig(budget=0)
    assert r2.dm.redelivered >= 4


def test_given_back_with_nothing_else_handed_out_drops_the_watermark(rig):
    """Messages released at a normal close stay uncounted after a crash."""
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()
    c = RecordingConsumer(credit=3)
    q.add_consumer(c)
    r.commit()
    assert r.store.read_watermark(q.store_id) > 0
    q.remove_consumer(c, [], failed=False)
    first, *rest = list(c.delivered)
    q.settle(first, Outcome.RELEASED)
    r.commit()
    assert r.store.read_watermark(q.store_id) > 0      # two still handed out
    for e in rest:
        q.settle(e, Outcome.RELEASED)
    r.commit()
    assert r.store.read_watermark(q.store_id) == 0


def test_a_late_commit_of_a_dropped_watermark_does_not_cover_new_deliveries(rig):
    r = rig(budget=0)
    q = r.broker.declare_queue("q", durable=True)
    entries = fill(q, 10)
    r.commit()
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)                       # raises the watermark; its commit is on its way
    q.remove_consumer(c, [], failed=False)
    q.settle(c.delivered[0], Outcome.RELEASED)   # dropped before that commit
    r.commit()                              # the old watermark's callback runs now
    wm = r.dm.watermarks[q.store_id]
    assert wm.committed == 0 and wm.pending == 0
    c2 = RecordingConsumer(credit=1)
    q.add_consumer(c2)
    assert c2.delivered[0].seq == entries[0].seq
    assert c2.delivered[0].stored_in < -1       # waits for the new watermark's batch
