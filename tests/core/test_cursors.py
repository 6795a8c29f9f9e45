"""core/cursors.py: a durable subscription's cursor into the topic log, one test per
rule.  `owed` lists the positions the member owes (the log's knowledge, given here
as a plain set); `NEXT` turns it into next_owed."""

from __future__ import annotations

from amqpbroker.core.cursors import Cursor


def next_owed(owed: set[int], last: int):
    def nxt(x: int) -> int:
        later = [p for p in owed if p > x]
        return min(later) if later else max(x + 1, last + 1)
    return nxt


def settle_all(c: Cursor, positions, owed, last):
    return [c.settle(p, next_owed(owed, last)) for p in positions]


def test_fifo_settling_moves_only_the_floor():
    owed = {3, 4, 7, 9}
    c = Cursor(joined=3)
    assert settle_all(c, [3, 4, 7], owed, 9) == [True, True, True]
    assert c.floor == 9 and c.ranges == []
    assert c.settled(3) and c.settled(8) and not c.settled(9)


def test_the_floor_skips_positions_the_member_does_not_owe():
    owed = {10, 20}
    c = Cursor(joined=1)
    settle_all(c, [10], owed, 25)
    assert c.floor == 20


def test_settling_everything_puts_the_floor_past_the_last_position():
    owed = {2, 3}
    c = Cursor(joined=1)
    settle_all(c, [2, 3], owed, 8)
    assert c.floor == 9 and c.settled(8)


def test_out_of_order_settling_makes_a_range_above_the_floor():
    owed = {1, 2, 3, 5, 8}
    c = Cursor(joined=1)
    settle_all(c, [3], owed, 8)
    assert c.floor == 1 and c.ranges == [[3, 3]]
    assert c.settled(3) and not c.settled(2) and not c.settled(5)


def test_ranges_merge_when_no_owed_position_lies_between():
    owed = {1, 2, 4, 7, 9}
    c = Cursor(joined=1)
    settle_all(c, [4, 9], owed, 9)
    assert c.ranges == [[4, 4], [9, 9]]          # 7 is owed and not settled: two ranges
    settle_all(c, [7], owed, 9)
    assert c.ranges == [[4, 9]]                  # 4..9 merged across the non-owed 5, 6, 8


def test_a_stuck_head_with_everything_after_it_settled_is_one_range():
    owed = set(range(1, 1001))
    c = Cursor(joined=1)
    settle_all(c, range(2, 1001), owed, 1000)
    assert c.floor == 1 and c.ranges == [[2, 1000]]
    settle_all(c, [1], owed, 1000)               # the head at last: the floor jumps past the range
    assert c.floor == 1001 and c.ranges == []


def test_settling_the_floor_absorbs_the_ranges_it_reaches():
    owed = {1, 2, 3, 4, 6}
    c = Cursor(joined=1)
    settle_all(c, [2, 3, 6], owed, 6)
    assert c.ranges == [[2, 3], [6, 6]]
    settle_all(c, [1], owed, 6)
    assert c.floor == 4 and c.ranges == [[6, 6]]


def test_settling_twice_changes_nothing():
    owed = {1, 2, 3}
    c = Cursor(joined=1)
    assert settle_all(c, [2, 2, 1, 1], owed, 3) == [True, False, True, False]
    assert c.floor == 3 and c.ranges == []


def test_a_floor_past_positions_that_stopped_being_owed_moves_on():
    """A record lost in a failed batch is owed by nobody any more: the floor does not
    wait for it."""
    owed = {1, 2, 3}
    c = Cursor(joined=1)
    settle_all(c, [2], owed, 3)
    owed.discard(1)                               # position 1 lost
    settle_all(c, [3], owed, 3)
    assert c.floor == 4 and c.ranges == []


def test_delivery_count_is_the_state_else_the_base_plus_the_bumps_above():
    c = Cursor(joined=1)
    c.set_state(5, 3, False)
    c.bumps = [10, 20]
    assert c.delivery_count(5, 0) == 3
    assert c.delivery_count(8, 1) == 3            # under both bumps
    assert c.delivery_count(15, 0) == 1           # under one
    assert c.delivery_count(25, 0) == 0


def test_settling_drops_the_state():
    c = Cursor(joined=1)
    c.set_state(1, 2, True)
    assert c.delivered(1)
    c.settle(1, next_owed({1, 2}, 2))
    assert 1 not in c.states and not c.delivered(1)


def test_recovery_counts_delivered_states_and_positions_up_to_the_watermark_once_more():
    c = Cursor(joined=1)
    c.set_state(3, 1, True)     # marked delivered (far from the head)
    c.set_state(4, 2, False)    # given back, under the watermark
    c.set_state(50, 0, False)   # above it, not delivered
    assert c.recover(watermark=10) == 2
    assert c.states == {3: (2, False), 4: (3, False), 50: (0, False)}
    assert c.bumps == [10]
    assert c.delivery_count(7, 0) == 1 and c.delivery_count(11, 0) == 0


def test_a_watermark_below_the_floor_is_no_bump():
    c = Cursor(joined=1, floor=20)
    c.recover(watermark=10)
    assert c.bumps == []


def test_prune_forgets_what_the_floor_passed():
    c = Cursor(joined=1, floor=10)
    c.bumps = [5, 15]
    c.states = {4: (1, False), 12: (1, False)}
    c.ranges = [[2, 3], [12, 14]]
    c.prune()
    assert c.bumps == [15] and c.states == {12: (1, False)} and c.ranges == [[12, 14]]


def test_rule_covers_from_joined_until_left():
    c = Cursor(joined=5, left=9)
    assert [p for p in range(1, 12) if c.covers(p)] == [5, 6, 7, 8]
    assert Cursor(joined=5).covers(10**9)


def test_skip_jumps_over_a_settled_range():
    c = Cursor(joined=1)
    c.ranges = [[4, 6]]
    assert c.skip(3) == 3 and c.skip(4) == 7 and c.skip(6) == 7 and c.skip(7) == 7
