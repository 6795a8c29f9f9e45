"""Scans that resume: a consumer that refuses entries (selector, message group) examines
each ready entry once, not once per message it takes; a dispatch call examines at most
SCAN_BUDGET entries before the rest waits for the next loop turn; browsers walk the
entries after their cursor in sequence order without sorting the list."""

from __future__ import annotations

from proton import symbol

from amqpbroker.core.entries import Entry, ReadyList
from amqpbroker.core.queues import DISPATCH_SLICE, SCAN_BUDGET, Outcome, Queue
from tests.core.helpers import Clock, RecordingConsumer, bodies, make_message


def colour(e) -> str:
    return e.msg.application_properties.get("colour")


class Counting(RecordingConsumer):
    """A selecting consumer that counts the entries it is asked about."""

    def __init__(self, accept, credit=0, **kw):
        super().__init__(credit=credit, accept=accept, **kw)
        self.asked = 0

    def accepts(self, entry):
        self.asked += 1
        return super().accepts(entry)


counting = Counting


def red(e) -> bool:
    return colour(e) == "red"


def fill(q, n, col, arrival=None, **fields):
    for i in range(n):
        q.enqueue(make_message(f"{col}{i}", properties={"colour": col}, arrival=arrival, **fields))


def run_turns(turns, limit=10_000):
    while turns and limit:
        turns.pop(0)()
        limit -= 1
    assert not turns, "the dispatch never settles"


# ---------------------------------------------------------------------- linear work


def test_taking_matching_messages_one_by_one_behind_non_matching_ones_is_linear():
    q = Queue("q")
    fill(q, 1000, "blue")
    fill(q, 1000, "red")
    c = counting(red)
    q.add_consumer(c)
    for _ in range(1000):       # one message per flow, as a slow client takes them
        c.grant(1, q)
    assert bodies(c.delivered) == [f"red{i}" for i in range(1000)]
    assert c.asked <= 2000 + 10, f"{c.asked} entries examined for 2000"
    assert q.ready_count == 1000


def test_a_consumer_waiting_while_messages_arrive_examines_each_once():
    q = Queue("q")
    c = counting(red, credit=10**6)
    q.add_consumer(c)
    for i in range(3000):
        fill(q, 1, "red" if i % 3 == 0 else "blue")
    assert len(c.delivered) == 1000 and c.asked == 3000


def test_marks_are_per_priority_level():
    # An old non-matching entry of a lower level must not send the scan of the
    # higher levels back to their start for every message taken.
    q = Queue("q")
    fill(q, 1, "blue", priority=0)
    fill(q, 1000, "blue", priority=9)
    fill(q, 500, "red", priority=4)
    c = counting(red)
    q.add_consumer(c)
    for _ in range(500):
        c.grant(1, q)
    assert len(c.delivered) == 500 and c.asked <= 1501 + 10


def test_several_selecting_consumers_each_keep_their_own_marks():
    q = Queue("q")
    fill(q, 500, "blue")
    fill(q, 500, "red")
    fill(q, 500, "green")
    reds, greens = counting(red), counting(lambda e: colour(e) == "green")
    q.add_consumer(reds)
    q.add_consumer(greens)
    for _ in range(500):
        reds.grant(1, q)
        greens.grant(1, q)
    assert len(reds.delivered) == len(greens.delivered) == 500
    assert reds.asked <= 1000 + 10 and greens.asked <= 1500 + 10


# ---------------------------------------------------------------------- bounded turns


def test_a_dispatch_call_examines_at_most_the_scan_budget_then_defers():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    fill(q, 3 * SCAN_BUDGET, "blue")
    fill(q, 10, "red")
    c = counting(red, credit=100)
    q.add_consumer(c)
    assert c.asked <= SCAN_BUDGET and c.delivered == [] and len(turns) == 1
    run_turns(turns)
    assert bodies(c.delivered) == [f"red{i}" for i in range(10)]
    assert c.asked == 3 * SCAN_BUDGET + 10


def test_the_scan_budget_resumes_across_turns_for_an_unfiltered_consumer_behind_a_group():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    owner, other = RecordingConsumer(credit=1), RecordingConsumer(credit=0)
    q.add_consumer(owner)
    q.add_consumer(other)
    fill(q, 2 * SCAN_BUDGET, "blue", group_id="g")   # owner takes the first, keeps the group
    run_turns(turns)
    fill(q, 5, "free")
    other.grant(5, q)
    run_turns(turns)
    assert bodies(other.delivered) == [f"free{i}" for i in range(5)]


def test_expired_entries_met_by_a_scan_are_expired():
    clock = Clock()
    q = Queue("q", clock=clock)
    fill(q, 3, "blue", ttl=1.0, arrival=clock.t)
    fill(q, 2, "red", ttl=1.0, arrival=clock.t)
    fill(q, 1, "red", arrival=clock.t)
    c = counting(red, credit=5)
    clock.t += 2
    q.add_consumer(c)
    assert bodies(c.delivered) == ["red0"] and q.expired_total == 5 and q.depth == 1


# ---------------------------------------------------------------------- marks invalidated


def test_a_released_message_below_the_mark_is_delivered_to_a_consumer_that_accepts_it():
    q = Queue("q")
    other = RecordingConsumer(credit=1)
    q.add_consumer(other)
    fill(q, 1, "red")                      # seq 1: `other` holds it
    fill(q, 50, "blue")
    picky = counting(red, credit=5)
    q.add_consumer(picky)                  # refuses the 50 blue: its mark is past them
    assert picky.delivered == [] and picky.asked == 50
    q.settle(other.delivered[0], Outcome.RELEASED)
    assert bodies(picky.delivered) == ["red0"]


def test_entries_returned_by_an_ended_link_are_scanned_again():
    q = Queue("q")
    holder = RecordingConsumer(credit=3)
    q.add_consumer(holder)
    fill(q, 3, "red")
    fill(q, 20, "blue")
    picky = counting(red, credit=10)
    q.add_consumer(picky)
    assert picky.delivered == []
    q.remove_consumer(holder, list(holder.delivered), failed=False)
    assert bodies(picky.delivered) == ["red0", "red1", "red2"]


def test_a_delivery_count_change_in_place_is_scanned_again():
    # A selector may read JMSXDeliveryCount: a late modified(delivery-failed) counts
    # an entry that is waiting again, and a consumer that refused it must look again.
    q = Queue("q")
    fill(q, 1, "red")
    retried = counting(lambda e: e.delivery_count >= 1, credit=5)
    q.add_consumer(retried)
    holder = RecordingConsumer(credit=1)
    q.add_consumer(holder)
    entry = holder.delivered[0]
    q.remove_consumer(holder, [entry], failed=False)   # back, released: count still 0
    assert retried.delivered == []
    q.settle_late(entry, Outcome.MODIFIED, delivery_failed=True)
    q.dispatch()
    assert retried.delivered == [entry] and entry.delivery_count == 1


def test_a_released_group_is_scanned_again_by_consumers_that_refused_it():
    q = Queue("q")
    owner, other = RecordingConsumer(credit=1), RecordingConsumer(credit=100)
    q.add_consumer(owner)
    q.add_consumer(other)
    fill(q, 1, "g", group_id="g1")
    assert len(owner.delivered) == 1
    q.settle(owner.delivered[0], Outcome.ACCEPTED)       # owner keeps the group, no credit
    fill(q, 4, "h", group_id="g1")
    fill(q, 2, "free")
    assert bodies(other.delivered) == ["free0", "free1"]  # refused the group's entries
    q.remove_consumer(owner, [], failed=False)            # the group is free now
    assert bodies(other.delivered) == ["free0", "free1", "h0", "h1", "h2", "h3"]


def test_an_undeliverable_here_entry_goes_to_the_others_only():
    q = Queue("q")
    a = RecordingConsumer(credit=1)
    q.add_consumer(a)
    fill(q, 1, "red")
    b = counting(red, credit=5)
    q.add_consumer(b)
    entry = a.delivered[0]
    a.grant(1)
    q.settle(entry, Outcome.MODIFIED, undeliverable_here=True)
    assert b.delivered == [entry] and a.delivered == [entry]


def test_a_scheduled_entry_overtaken_by_newer_ones_is_seen_when_due():
    clock = Clock()
    q = Queue("q", clock=clock)
    q.enqueue(make_message("later", properties={"colour": "red"}, arrival=clock.t,
                           annotations={symbol("x-opt-delivery-delay"): 5000}))
    fill(q, 10, "blue")
    c = counting(red, credit=5)
    q.add_consumer(c)
    assert c.delivered == [] and c.asked == 10
    clock.t += 5
    q.promote_due(clock.t)
    assert bodies(c.delivered) == ["later"]


# ---------------------------------------------------------------------- priorities


def test_a_higher_priority_matching_message_arriving_later_is_taken_first():
    q = Queue("q")
    fill(q, 100, "blue", priority=4)
    c = counting(red, credit=1)
    q.add_consumer(c)                      # marks past the 100 blue
    c._credit = 0
    q.enqueue(make_message("low", properties={"colour": "red"}, priority=0))
    q.enqueue(make_message("mid", properties={"colour": "red"}, priority=4))
    q.enqueue(make_message("high", properties={"colour": "red"}, priority=9))
    c.grant(3, q)
    assert bodies(c.delivered) == ["high", "mid", "low"]
    assert c.asked == 103


def test_a_returned_entry_keeps_its_place_before_newer_ones_of_its_level():
    q = Queue("q")
    holder = RecordingConsumer(credit=1)
    q.add_consumer(holder)
    q.enqueue(make_message("first", properties={"colour": "red"}))
    picky = counting(red, credit=1)
    q.add_consumer(picky)
    q.enqueue(make_message("second", properties={"colour": "red"}))
    q.enqueue(make_message("third", properties={"colour": "red"}))
    assert bodies(picky.delivered) == ["second"]          # its mark is past seq 2
    q.settle(holder.delivered[0], Outcome.RELEASED)       # seq 1 comes back
    picky.grant(2, q)
    assert bodies(picky.delivered) == ["second", "first", "third"]


# ---------------------------------------------------------------------- browsing


def test_a_browser_sees_entries_in_sequence_order_whatever_their_priority_each_once():
    q = Queue("q")
    for i, p in enumerate([4, 9, 0, 9, 4, 1] * 100):
        q.enqueue(make_message(i, priority=p))
    b = RecordingConsumer(credit=250, browser=True)
    q.add_consumer(b)
    assert bodies(b.copies) == list(range(250))
    b.grant(1000, q)
    assert bodies(b.copies) == list(range(600)) and q.ready_count == 600
    q.enqueue(make_message("new", priority=0))
    assert bodies(b.copies)[-1] == "new" and len(b.copies) == 601


def test_a_filtered_browser_skips_what_it_does_not_select_within_the_budget():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    fill(q, 2 * SCAN_BUDGET, "blue")
    fill(q, 3, "red", priority=0)
    b = counting(red, credit=10, browser=True)
    q.add_consumer(b)
    assert b.asked <= SCAN_BUDGET and b.copies == []
    run_turns(turns)
    assert bodies(b.copies) == ["red0", "red1", "red2"] and b.asked == 2 * SCAN_BUDGET + 3


def test_a_browser_is_bounded_by_the_dispatch_slice():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    fill(q, DISPATCH_SLICE * 2 + 5, "blue")
    b = RecordingConsumer(credit=10**6, browser=True)
    q.add_consumer(b)
    assert len(b.copies) == DISPATCH_SLICE
    run_turns(turns)
    assert len(b.copies) == DISPATCH_SLICE * 2 + 5


# ---------------------------------------------------------------------- the ready list


def _entry(seq, priority=4):
    e = Entry(None, seq)
    e.priority = priority
    return e


def test_ready_list_remove_and_contains_find_an_entry_by_sequence():
    ready = ReadyList()
    es = [_entry(s) for s in range(1, 2001)]
    for e in es:
        ready.push(e)
    ready.remove(es[999])
    assert es[999] not in ready and es[998] in ready and es[1000] in ready and len(ready) == 1999
    ready.push(es[999])
    assert [e.seq for e in ready] == list(range(1, 2001))


def test_ready_list_windows_and_merge_by_sequence():
    ready = ReadyList()
    for s in range(1, 101):
        ready.push(_entry(s, priority=s % 3))
    assert [e.seq for e in ready.level_from(1, 50, 5)] == [52, 55, 58, 61, 64]
    assert [e.seq for e in ready.level_from(1, 95, 5)] == [97, 100]
    assert [e.seq for e in ready.after(40, 7)] == list(range(41, 48))
    assert [e.seq for e in ready.after(95, 100)] == [96, 97, 98, 99, 100]
    assert ready.after(100, 5) == [] and ready.level_from(9, 0, 5) == []


def test_ready_list_lowers_marks_only_for_pushes_below_the_highest_sequence():
    ready = ReadyList()
    for s in (1, 2, 3):
        ready.push(_entry(s))
    marks = ready.marks(7)
    marks[4] = 4                          # the consumer refused 1..3
    ready.push(_entry(10))                # new: past every mark
    assert ready.marks(7)[4] == 4
    ready.push(_entry(5))                 # overtaken (paged in, scheduled): below 10
    assert ready.marks(7)[4] == 4         # 5 is above the mark: nothing to redo
    back = _entry(2, priority=4)
    ready.remove(next(e for e in ready if e.seq == 2))
    ready.push(back)                      # came back below the mark
    assert ready.marks(7)[4] == 2 and ready.marks(8) == [0] * 10
    ready.forget(7)
    assert ready.marks(7) == [0] * 10


def test_ready_list_matches_a_sorted_model_through_splits_and_removals(monkeypatch):
    import random

    from amqpbroker.core import entries
    monkeypatch.setattr(entries, "BLOCK", 4)    # many blocks, many splits
    rnd = random.Random(7)
    ready, model, gone = ReadyList(), {}, []
    for seq in range(1, 3001):
        op = rnd.random()
        if op < 0.45:
            e = _entry(seq, priority=rnd.choice((0, 4, 9)))
            ready.push(e)
            model[seq] = e
        elif op < 0.6 and gone:                       # an entry comes back
            e = gone.pop(rnd.randrange(len(gone)))
            ready.push(e)
            model[e.seq] = e
        elif op < 0.75 and model:                     # taken from anywhere
            e = model.pop(rnd.choice(list(model)))
            ready.remove(e)
            gone.append(e)
        elif op < 0.85:
            e = ready.pop_first()
            if e is not None:
                del model[e.seq]
                gone.append(e)
        elif op < 0.87:
            below = rnd.randint(0, seq)
            for e in ready.pop_below(below):
                del model[e.seq]
                gone.append(e)
        order = sorted(model.values(), key=lambda e: (-e.priority, e.seq))
        assert len(ready) == len(model)
        if seq % 50 == 0:
            assert list(ready) == order
            cut = rnd.randint(0, seq)
            assert ready.after(cut, 7) == sorted((e for e in order if e.seq > cut), key=lambda e: e.seq)[:7]
            for p in (0, 4, 9):
                assert ready.level_from(p, cut, 5) == [e for e in order if e.priority == p and e.seq >= cut][:5]
            assert all(e in ready for e in order) and not any(e in ready for e in gone)
