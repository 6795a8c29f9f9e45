"""Moving and browsing the waiting entries of a durable queue with a paged region
(core/waiting.py, core/moves.py) through DurabilityManager on a real LmdbStore:
store-only entries are read a page at a time, each move removes the source entry
and writes the copy in one batch, and page-in never brings a moved entry back."""

from __future__ import annotations

from amqpbroker.core import moves
from amqpbroker.core.moves import Move, compile_filter
from tests.store.test_paging import Rig, drain, fill, loop, msg_size, rig, small_window  # noqa: F401


def run(move: Move, rig_: Rig, commit_every: bool = False) -> dict:
    while not move.step():
        if commit_every:
            rig_.commit()
    return move.report.view()


def test_waiting_after_reads_the_paged_region_a_page_at_a_time(rig):
    r = rig(budget=3 * msg_size())
    q = r.broker.declare_queue("q", durable=True)
    fill(q, 10)
    r.commit()
    assert q.paged_count == 7 and q._pending_page == {}
    seen = [(e.seq, s) for e, s in q.waiting_after(0, 100)]
    assert seen == [(i, "ready") for i in (1, 2, 3)] + [(i, "paged") for i in range(4, 11)]
    assert [e.seq for e, _ in q.waiting_after(5, 2)] == [6, 7]
    assert q.paged_count == 7 and len(q._ready) == 3   # browsing changed nothing


def test_move_of_a_paged_queue_is_exact_in_memory_and_in_the_store(rig, monkeypatch):
    monkeypatch.setattr(moves, "SLICE", 4)
    r = rig(budget=3 * msg_size())
    src = r.broker.declare_queue("src", durable=True)
    dst = r.broker.declare_queue("dst", durable=True)
    fill(src, 12)
    r.commit()
    report = run(Move(r.broker, src, to="dst", replay=False), r)
    assert report["moved"] == 12
    r.commit()
    assert src.depth == 0 and src.paged_count == 0 and src.bytes == 0 and r.count(src) == 0
    assert dst.depth == 12 and r.count(dst) == 12
    assert drain(dst, 12) == [f"m{i:02d}" for i in range(12)]
    assert src._paged_gone == set()


def test_a_moved_paged_entry_is_not_paged_in_before_its_removal_commits(rig):
    r = rig(budget=2 * msg_size())
    src = r.broker.declare_queue("src", durable=True)
    r.broker.declare_queue("dst", durable=True)
    fill(src, 8)
    r.commit()
    sel = compile_filter("JMSXDeliveryCount >= 1", 4096)  # every message
    move = Move(r.broker, src, to="dst", replay=False, selector=sel, limit=4)
    move.step()   # the first four: two ready, two store-only; nothing committed yet
    assert move.report.moved == 4
    # A consumer now drains the source before the batch commits: it must get only
    # the four that stayed.
    assert drain(src, 10) == ["m04", "m05", "m06", "m07"]
    r.commit()
    assert r.count(src) == 0


def test_move_with_a_selector_leaves_the_others_paged(rig):
    r = rig(budget=2 * msg_size())
    src = r.broker.declare_queue("src", durable=True)
    dst = r.broker.declare_queue("dst", durable=True)
    for i in range(10):
        fill(src, 1, start=i, properties={"even": i % 2 == 0})
    r.commit()
    report = run(Move(r.broker, src, to="dst", replay=False, selector=compile_filter("even = TRUE", 4096)), r,
                 commit_every=True)
    assert report["moved"] == 5 and report["examined"] == 10
    r.commit()
    assert dst.depth == 5 and src.depth == 5 and r.count(src) == 5 and r.count(dst) == 5
    assert drain(src, 10) == ["m01", "m03", "m05", "m07", "m09"]
    assert drain(dst, 10) == ["m00", "m02", "m04", "m06", "m08"]
    r.commit()
    assert r.count(src) == 0 and r.count(dst) == 0
