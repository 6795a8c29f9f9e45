"""core/history.py (a message's move / replay / dead-letter history and the rule
built on it), core/sections.py (the map-section rewrite it is written with) and
core/ratelog.py (lines that cannot flood the log): a test per decision."""

from __future__ import annotations

import logging

import pytest
from proton import Message as PnMessage

from amqpbroker.core import history
from amqpbroker.core.deadletters import (
    DLQ_KEYS, PROPERTY_KEYS, history_of, mark_dead_lettered, mark_moved,
)
from amqpbroker.core.ratelog import RateLimitedLog
from amqpbroker.core.sections import APPLICATION_PROPERTIES, SectionError, read_map, rewrite_map


def records(*rows):
    return [history.Record(q, r, c, op, 0) for q, r, c, op in rows]


@pytest.mark.parametrize("before,queue,reason,op,after", [
    ([], "q", "rejected", "dead-letter", [("q", "rejected", 1, "dead-letter")]),
    ([("q", "rejected", 1, "dead-letter")], "q", "rejected", "dead-letter", [("q", "rejected", 2, "dead-letter")]),
    ([("q", "rejected", 1, "dead-letter")], "q", "overflow", "dead-letter",
     [("q", "rejected", 1, "dead-letter"), ("q", "overflow", 1, "dead-letter")]),
    ([("q", "moved", 1, "move-1"), ("r", "rejected", 1, "dead-letter")], "q", "moved", "move-2",
     [("r", "rejected", 1, "dead-letter"), ("q", "moved", 2, "move-2")]),     # newest last, op the last one
], ids=["first", "again", "another-reason", "moves-to-the-end"])
def test_add(before, queue, reason, op, after):
    got = history.add(records(*before), queue, reason, op, 0)
    assert [(r.queue, r.reason, r.count, r.op) for r in got] == after


def test_the_history_is_bounded():
    rows = records(*[(f"q{i}", "moved", 1, "m") for i in range(history.MAX_RECORDS)])
    got = history.add(rows, "new", "moved", "m", 0)
    assert len(got) == history.MAX_RECORDS and got[0].queue == "q1" and got[-1].queue == "new"


@pytest.mark.parametrize("reason,op,excluded", [
    ("moved", "move-1", {"src"}),          # the same operation: not back into its source
    ("moved", "move-2", set()),            # another operation may move it there again
    ("replayed", "move-1", set()),         # another reason
])
def test_excluded(reason, op, excluded):
    rows = records(("src", "moved", 1, "move-1"), ("q", "rejected", 1, "dead-letter"))
    assert history.excluded(rows, reason, op) == excluded


@pytest.mark.parametrize("value", [None, "x", [1, "a"], [{"queue": 3}], [{"reason": "moved"}]])
def test_what_a_producer_sent_under_the_key_is_not_a_record(value):
    assert history.parse(value) == []


def test_marks_round_trip_through_proton():
    raw = PnMessage(body="b", properties={"kind": "order"}).encode()
    dead = mark_dead_lettered(raw, "orders", "orders", "rejected", 1234)
    m = PnMessage()
    m.decode(dead)
    assert m.properties == {"kind": "order", "_AMQPBROKER_DLQ_QUEUE": "orders", "_AMQPBROKER_DLQ_ADDRESS": "orders",
                            "_AMQPBROKER_DLQ_REASON": "rejected", "_AMQPBROKER_DLQ_TIME": 1234}
    assert [(r.queue, r.reason, r.count) for r in history_of(dead)] == [("orders", "rejected", 1)]
    back = mark_moved(dead, "DLQ", "replay-1", 5678, replay=True)
    m.decode(back)
    assert m.properties == {"kind": "order"} and m.body == "b"
    assert not set(m.annotations) & set(DLQ_KEYS)
    assert [(r.queue, r.reason) for r in history_of(back)] == [("orders", "rejected"), ("DLQ", "replayed")]
    # Taking the history out too gives the producer's bytes back (the sections' width is kept).
    assert rewrite_map(back, 0x72, drop=[history.HISTORY]) == raw


def test_application_properties_are_created_where_section_order_puts_them():
    raw = PnMessage(body="b", subject="s").encode()      # header? properties, body: no application-properties
    out = rewrite_map(raw, APPLICATION_PROPERTIES, {PROPERTY_KEYS[0]: "q"})
    m = PnMessage()
    m.decode(out)
    assert m.properties == {"_AMQPBROKER_DLQ_QUEUE": "q"} and m.subject == "s" and m.body == "b"
    assert read_map(out, APPLICATION_PROPERTIES) == {"_AMQPBROKER_DLQ_QUEUE": "q"}


def test_unwalkable_sections_raise():
    with pytest.raises(SectionError):
        rewrite_map(b"\x00\x53\x74\xa1\x01x", APPLICATION_PROPERTIES, {"a": "b"})   # not a map


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_one_line_per_kind_per_interval_and_the_next_says_how_many_were_left_out(caplog):
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.ratelog"):
        assert rl.log(logging.INFO, "a", "line %d", 1) is True
        assert rl.log(logging.INFO, "a", "line %d", 2) is False
        assert rl.log(logging.INFO, "b", "other %d", 1) is True     # another kind
        clock.t = 10.5
        assert rl.log(logging.INFO, "a", "line %d", 3) is True
    assert [r.getMessage() for r in caplog.records] == [
        "line 1", "other 1", "line 3 (1 similar line(s) left out in the last 10 s)"]


def test_the_table_of_kinds_is_bounded():
    rl = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10, clock=Clock())
    for i in range(RateLimitedLog.MAX_KINDS * 2):
        rl.log(logging.DEBUG, i, "x")
    assert len(rl._kinds) <= RateLimitedLog.MAX_KINDS
