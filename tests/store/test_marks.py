"""The delivery watermark's decisions (store/marks.py): when a hand-over needs a
write, which one, and what it waits for."""

from __future__ import annotations

from amqpbroker.store.marks import Mark, Watermark

L = 100
T = 10**6   # the queue's tail: far away unless a test says otherwise


def test_first_delivery_at_the_head_raises_the_watermark_ahead():
    wm = Watermark()
    assert wm.decide(1000, T, lambda: 1001, L) == (Mark.RAISED, 1100)


def test_deliveries_under_a_pending_watermark_wait_then_are_covered():
    wm = Watermark()
    wm.written(1100, batch=5)
    assert wm.decide(1001, T, lambda: 1002, L) == (Mark.PENDING, 0)
    wm.settled(1100, ok=True)
    assert wm.decide(1002, T, lambda: 1003, L) == (Mark.COVERED, 0)


def test_the_watermark_is_raised_again_before_the_deliveries_reach_it():
    wm = Watermark()
    wm.written(1100, 5)
    wm.settled(1100, True)
    assert wm.decide(1049, T, lambda: 1050, L) == (Mark.COVERED, 0)
    assert wm.decide(1051, T, lambda: 1052, L) == (Mark.COVERED, 1151)   # within half of it: ahead of time
    wm.written(1151, 9)
    assert wm.decide(1052, T, lambda: 1053, L) == (Mark.COVERED, 0)     # 1100 committed covers it
    assert wm.decide(1101, T, lambda: 1102, L) == (Mark.PENDING, 0)     # only 1151, on its way, does
    assert wm.committed == 1100 and wm.pending == 1151


def test_a_delivery_far_from_the_head_gets_its_own_mark():
    wm = Watermark()
    wm.written(1100, 5)
    wm.settled(1100, True)
    # a high-priority message 10,000 sequences on, the backlog's head still at 1060
    assert wm.decide(11_000, T, lambda: 1060, L) == (Mark.ENTRY, 0)
    assert wm.pending == 1100


def test_a_jump_with_nothing_ready_below_raises():
    wm = Watermark()
    assert wm.decide(50_000, T, lambda: None, L) == (Mark.RAISED, 50_100)   # nothing below it is ready
    assert wm.decide(50_000, T, lambda: 49_950, L) == (Mark.RAISED, 50_100)  # 50 ready below: bounded


def test_a_failed_write_is_written_again():
    wm = Watermark()
    wm.written(1100, 5)
    wm.settled(1100, ok=False)
    assert wm.pending == 0 and wm.committed == 0
    assert wm.decide(1001, T, lambda: 1002, L) == (Mark.RAISED, 1101)


def test_a_failed_write_does_not_undo_a_later_one():
    wm = Watermark()
    wm.written(1100, 5)
    wm.written(1200, 6)
    wm.settled(1100, ok=False)
    assert wm.pending == 1200
    wm.settled(1200, ok=True)
    assert wm.committed == 1200


def test_the_watermark_never_passes_the_tail():
    """Messages that arrive after a drain are above it: a crash later marks none of them."""
    wm = Watermark()
    assert wm.decide(1000, 1010, lambda: None, L) == (Mark.RAISED, 1010)
    wm.written(1010, 5)
    wm.settled(1010, True)
    assert wm.decide(1010, 1010, lambda: None, L) == (Mark.COVERED, 0)   # nothing above to cover
    assert wm.decide(1011, 1030, lambda: None, L) == (Mark.RAISED, 1030)  # the next turn's arrivals
