"""LmdbStore against a real LMDB environment (tmp_path) and a real asyncio loop.

No mocks: operations are queued on the loop thread as the broker does, the writer
process commits them, and the tests look at what a reader (or a reopened store) sees.
"""

from __future__ import annotations

import asyncio
import threading

import lmdb
import pytest

from amqpbroker.store.base import FORMAT_VERSION, EntryRecord, StoreError, StoreFull
from amqpbroker.store.lmdb_store import LmdbStore
from tests.store.helpers import close, commit, entry, put, queue_record, reopen

MiB = 1 << 20


# ---------------------------------------------------------------------- group commit


def test_many_operations_of_one_loop_turn_are_one_commit(opened, loop):
    store = opened()
    before = store.commits
    seen = []
    main = threading.get_ident()
    mids = []
    for i in range(1, 1001):
        mid = put(store, 1, i, b"body-%d" % i)
        mids.append(mid)
        # Each callback checks, on the thread it runs on, that its data is readable.
        store.after_commit(lambda err, i=i, mid=mid: seen.append(
            (i, err, threading.get_ident() == main, store.read_message(mid))))
    assert commit(loop, store) is None
    assert store.commits == before + 1, "one write transaction (one fsync) for the whole batch"
    assert store.last_batch_ops == 1000 * 3 + 1
    assert [s[0] for s in seen] == list(range(1, 1001)), "callbacks run in the order given"
    assert all(err is None and on_loop for _, err, on_loop, _ in seen)
    assert all(raw == b"body-%d" % i for i, _, _, raw in seen)
    assert [r.seq for r in store.read_entries(1, 0, 5000)] == list(range(1, 1001))


def test_operations_queued_while_the_writer_is_busy_share_a_commit(opened, loop):
    """Operations of many loop turns queued during one fsync are committed together."""
    store = opened()
    before = store.commits
    order: list[int] = []
    turns = 300

    async def produce():
        for i in range(1, turns + 1):
            put(store, 1, i, b"x" * 512)
            store.after_commit(lambda err, i=i: order.append(i))
            await asyncio.sleep(0)   # a new loop turn: a new hand-off to the writer
        fut = loop.create_future()
        store.after_commit(lambda err: fut.set_result(err))
        return await asyncio.wait_for(fut, 20)

    assert loop.run_until_complete(produce()) is None
    assert order == list(range(1, turns + 1))
    assert store.commits - before < turns, "hand-offs made during a commit are coalesced"
    assert store.count_entries(1) == turns


def test_callbacks_of_later_batches_see_earlier_data_and_run_on_the_loop(opened, loop):
    store = opened()
    mid = put(store, 4, 1, b"first")
    results = []
    store.after_commit(lambda err: results.append(("a", store.read_message(mid))))
    loop.run_until_complete(asyncio.sleep(0))
    mid2 = put(store, 4, 2, b"second")
    store.after_commit(lambda err: results.append(("b", store.read_message(mid), store.read_message(mid2))))
    commit(loop, store)
    assert results == [("a", b"first"), ("b", b"first", b"second")]


def test_flush_blocks_until_everything_queued_is_committed(opened, loop):
    store = opened()
    mid = put(store, 1, 1, b"flushed")
    store.flush()
    assert store.read_message(mid) == b"flushed"


# ---------------------------------------------------------------------- coalescing


def test_put_and_delete_in_one_batch_never_reach_the_disk(opened, loop):
    store = opened()
    commit(loop, store)  # settle the environment's first pages
    last_pgno = store.env.info()["last_pgno"]
    big = b"B" * (4 * MiB)
    mid = put(store, 1, 1, big)
    store.delete_entry(1, 1)
    store.drop_message(mid)
    assert commit(loop, store) is None
    assert store.read_message(mid) is None
    assert store.read_entries(1, 0, 10) == []
    # 4 MiB written would have taken ~1024 overflow pages, even if freed in the same txn.
    assert store.env.info()["last_pgno"] - last_pgno < 64


def test_a_message_shared_by_entries_is_written_once_and_outlives_one_entry(opened, loop):
    store = opened()
    mid = store.new_msg_id()
    store.put_message(mid, b"fan-out")
    for qid in (1, 2, 3):
        store.put_entry(qid, entry(7, mid, size=7))
    store.delete_entry(2, 7)           # one queue's consumer was faster than the commit
    assert commit(loop, store) is None
    assert store.read_message(mid) == b"fan-out"
    assert [(r.seq, r.msg_id) for r in store.read_entries(1, 0, 10)] == [(7, mid)]
    assert store.read_entries(2, 0, 10) == []
    assert [(r.seq, r.msg_id) for r in store.read_entries(3, 0, 10)] == [(7, mid)]
    with store.env.begin() as txn:
        assert txn.stat(store._dbs["messages"])["entries"] == 1
    store.delete_entry(1, 7)
    commit(loop, store)
    assert store.read_message(mid) == b"fan-out", "still referred to by queue 3"
    store.delete_entry(3, 7)
    store.drop_message(mid)
    commit(loop, store)
    assert store.read_message(mid) is None
    assert store.read_entries(3, 0, 10) == []


# ---------------------------------------------------------------------- sequences, ids


def test_sequence_high_water_mark_survives_reopen_with_every_entry_deleted(opened, loop):
    store = opened()
    store.save_queue(queue_record("drained", 3))
    store.save_queue(queue_record("never-stored", 4))
    mids = [put(store, 3, seq, b"m") for seq in range(1, 6)]
    commit(loop, store)
    for seq, mid in zip(range(1, 6), mids):
        store.delete_entry(3, seq)
        store.drop_message(mid)
    # queue 4: an entry written and acknowledged within one batch (never on disk)
    mid4 = put(store, 4, 41, b"gone")
    store.delete_entry(4, 41)
    store.drop_message(mid4)
    commit(loop, store)
    assert store.read_entries(3, 0, 10) == []
    store, snap = reopen(loop, store)
    try:
        last = {q.name: q.last_seq for q in snap.queues}
        assert last == {"drained": 5, "never-stored": 41}
        assert store.read_entries(3, 0, 10) == [] and store.read_entries(4, 0, 10) == []
        assert snap.next_msg_id == mid4 + 1
        assert store.new_msg_id() == mid4 + 1, "message ids are never reused"
    finally:
        close(loop, store)


def test_entities_survive_reopen(opened, loop):
    store = opened()
    store.save_exchange("orders", "topic")
    store.save_queue(queue_record("q1", 1))
    store.save_binding("orders", "a.#", "q1", {"selector": "n > 1"})
    store.save_subscription("q1", {"queue": "q1", "links": ["l1"]})
    store.save_exchange("gone", "direct")
    store.delete_exchange("gone")
    commit(loop, store)
    store, snap = reopen(loop, store)
    try:
        assert snap.exchanges == [{"name": "orders", "type": "topic"}]
        assert [(q.name, q.queue_id) for q in snap.queues] == [("q1", 1)]
        assert snap.bindings == [{"exchange": "orders", "key": "a.#", "queue": "q1",
                                  "arguments": {"selector": "n > 1"}}]
        assert snap.subscriptions == [{"queue": "q1", "links": ["l1"]}]
    finally:
        close(loop, store)


# ---------------------------------------------------------------------- read_entries


def test_read_entries_order_limit_after_and_queue_boundaries(opened, loop):
    store = opened()
    seqs = [3, 1, 256, 2, 65536, 1 << 33, 255]
    for seq in seqs:
        put(store, 1, seq, b"q1-%d" % seq)
    for seq in (2, 1):
        put(store, 2, seq, b"q2")
    put(store, 0, 5, b"q0")
    put(store, 256, 1, b"q256")       # big-endian ids: 256 sorts after 1 and 2
    commit(loop, store)
    ordered = sorted(seqs)
    assert [r.seq for r in store.read_entries(1, 0, 100)] == ordered
    assert [r.seq for r in store.read_entries(1, 0, 3)] == ordered[:3]
    assert [r.seq for r in store.read_entries(1, 2, 2)] == [3, 255]
    assert [r.seq for r in store.read_entries(1, 255, 100)] == [256, 65536, 1 << 33]
    assert store.read_entries(1, 1 << 33, 10) == []
    assert [r.seq for r in store.read_entries(2, 0, 10)] == [1, 2]
    assert [r.seq for r in store.read_entries(0, 0, 10)] == [5]
    assert [r.seq for r in store.read_entries(256, 0, 10)] == [1]
    assert store.read_entries(9, 0, 10) == []
    assert store.count_entries(1) == len(seqs)
    # Paging through with after/limit sees every entry once, in order.
    got, after = [], 0
    while batch := store.read_entries(1, after, 2):
        got += [r.seq for r in batch]
        after = batch[-1].seq
    assert got == ordered


def test_entry_fields_round_trip_and_updates(opened, loop):
    store = opened()
    full = EntryRecord(9, 123, 2, True, 7, 4096, 1_900_000_000.5, 1_800_000_000.25, "grp-é")
    bare = EntryRecord(10, 124, 0)
    store.put_entry(5, full)
    store.put_entry(5, bare)
    commit(loop, store)
    assert store.read_entries(5, 0, 10) == [full, bare]
    store.update_entry(5, EntryRecord(10, 124, 1, True))
    commit(loop, store)
    assert store.read_entries(5, 9, 10) == [EntryRecord(10, 124, 1, True)]


def test_delete_queue_drops_only_that_queues_entries(opened, loop):
    store = opened()
    store.save_queue(queue_record("a", 1))
    store.save_queue(queue_record("b", 2))
    for seq in range(1, 4):
        put(store, 1, seq, b"a")
        put(store, 2, seq, b"b")
    commit(loop, store)
    put(store, 1, 4, b"a-late")       # same batch as the deletion
    store.delete_queue(1, "a")
    commit(loop, store)
    assert store.read_entries(1, 0, 10) == []
    assert [r.seq for r in store.read_entries(2, 0, 10)] == [1, 2, 3]
    store, snap = reopen(loop, store)
    try:
        assert [q.name for q in snap.queues] == ["b"]
    finally:
        close(loop, store)


# ---------------------------------------------------------------------- format version


def test_new_store_records_the_format_version(opened, loop):
    store = opened()
    with store.env.begin() as txn:
        assert txn.get(b"format", db=store._dbs["meta"]) == str(FORMAT_VERSION).encode()


def test_store_of_another_format_version_is_refused_at_open(tmp_path, loop):
    path = tmp_path / "store"
    store = LmdbStore(path)
    store.open(loop)
    store.close()
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreError) as refused:
        LmdbStore(path).open(loop)
    msg = str(refused.value)
    assert "format version 99" in msg and f"version {FORMAT_VERSION}" in msg and str(path) in msg
    assert not isinstance(refused.value, StoreFull)


# ---------------------------------------------------------------------- map size


def test_map_grows_from_a_tiny_initial_size_and_reopens(opened, loop, tmp_path):
    store = opened(map_size=1 * MiB, max_map_size=64 * MiB)
    assert store.map_size == 1 * MiB
    bodies = {}
    for seq in range(1, 41):          # 40 × 100 KiB in one batch: > 4 MiB
        raw = bytes([seq]) * (100 << 10)
        bodies[put(store, 1, seq, raw)] = raw
    assert commit(loop, store) is None
    grown = store.map_size
    assert grown >= 4 * MiB and grown <= 64 * MiB
    assert not store.full
    for seq in range(41, 81):         # and again, in later batches
        raw = bytes([seq]) * (100 << 10)
        bodies[put(store, 1, seq, raw)] = raw
        if seq % 10 == 0:
            assert commit(loop, store) is None
    assert store.map_size >= 8 * MiB
    store, _ = reopen(loop, store, map_size=1 * MiB)
    try:
        assert store.map_size >= 8 * MiB, "a grown store opens at its grown size"
        assert [r.seq for r in store.read_entries(1, 0, 100)] == list(range(1, 81))
        assert all(store.read_message(mid) == raw for mid, raw in bodies.items())
        # and it keeps growing after the reopen
        for seq in range(81, 121):
            put(store, 1, seq, b"z" * (100 << 10))
        assert commit(loop, store) is None
        assert store.count_entries(1) == 120
    finally:
        close(loop, store)


def test_maximum_map_size_gives_store_full_to_callbacks(opened, loop):
    store = opened(map_size=1 * MiB, max_map_size=2 * MiB)
    small = put(store, 1, 1, b"small")
    assert commit(loop, store) is None
    errors = []
    mids = []
    for seq in range(2, 32):           # 30 × 100 KiB: more than the 2 MiB maximum
        mids.append(put(store, 1, seq, b"F" * (100 << 10)))
        store.after_commit(errors.append)
    err = commit(loop, store)
    assert isinstance(err, StoreFull) and "maximum" in str(err)
    assert len(errors) == 30 and all(isinstance(e, StoreFull) for e in errors)
    assert store.full
    assert store.map_size == 2 * MiB
    # Nothing of the failed batch is there; what was committed before is intact.
    assert all(store.read_message(mid) is None for mid in mids)
    assert [r.seq for r in store.read_entries(1, 0, 100)] == [1]
    assert store.read_message(small) == b"small"
    # The store still takes writes that fit.
    mid = put(store, 1, 40, b"fits")
    assert commit(loop, store) is None
    assert store.read_message(mid) == b"fits"
    store, _ = reopen(loop, store, map_size=1 * MiB)
    try:
        assert [r.seq for r in store.read_entries(1, 0, 100)] == [1, 40]
        assert not store.full
    finally:
        close(loop, store)


def test_full_flag_clears_once_space_is_freed(opened, loop):
    """After StoreFull, draining the store makes it writable again (`full` goes back
    to False): LMDB's last page number is a high-water mark, not the space in use."""
    store = opened(map_size=1 * MiB, max_map_size=2 * MiB)
    kept = []
    seq = 0
    while True:                         # fill in small batches until the map is full
        seq += 1
        mid = put(store, 1, seq, b"K" * (100 << 10))
        err = commit(loop, store)
        if err is not None:
            break
        kept.append((seq, mid))
    assert isinstance(err, StoreFull) and store.full
    assert len(kept) >= 15
    for seq, mid in kept:
        store.delete_entry(1, seq)
        store.drop_message(mid)
    assert commit(loop, store) is None
    # LMDB reuses the pages freed by a transaction from the one after next on.
    put(store, 2, 1, b"tick")
    assert commit(loop, store) is None
    assert store.read_entries(1, 0, 100) == []
    assert not store.full, "the store is empty again but still reports full"
    for seq in range(100, 110):          # and the freed pages take new messages
        put(store, 1, seq, b"N" * (100 << 10))
    assert commit(loop, store) is None
    assert store.count_entries(1) == 10


def test_map_grows_up_to_a_maximum_that_is_not_a_doubling_of_the_initial_size(opened, loop):
    store = opened(map_size=1 * MiB, max_map_size=3 * MiB)
    for seq in range(1, 23):             # ~2.2 MiB: past 2 MiB, within 3 MiB
        put(store, 1, seq, b"G" * (100 << 10))
        assert commit(loop, store) is None, f"message {seq}"
    assert store.map_size == 3 * MiB
    assert not store.full


def test_a_batch_that_does_not_fit_still_commits_its_removals_and_reports_lost_entries(opened, loop):
    """Acknowledgements batched with a message that does not fit must not be lost (the
    broker already forgot those entries); the new entries that were not stored are
    reported to `on_lost_entries` on the loop thread before the batch's callbacks."""
    store = opened(map_size=1 * MiB, max_map_size=2 * MiB)
    kept = [put(store, 1, seq, b"k" * 1000) for seq in range(1, 4)]
    assert commit(loop, store) is None
    events = []
    main = threading.get_ident()
    store.on_lost_entries = lambda lost: events.append(("lost", sorted(lost), threading.get_ident() == main))
    store.delete_entry(1, 1)                  # acknowledged
    store.drop_message(kept[0])
    store.update_entry(1, EntryRecord(2, kept[1], 0, True))   # delivered
    put(store, 1, 4, b"H" * (3 * MiB))        # does not fit in 2 MiB
    put(store, 7, 1, b"small, same batch")
    mid = put(store, 1, 5, b"cancelled")      # written and acknowledged in the batch
    store.delete_entry(1, 5)
    store.drop_message(mid)
    store.after_commit(lambda err: events.append(("callback", type(err).__name__)))
    commit(loop, store)
    assert events == [("lost", [(1, 4), (7, 1)], True), ("callback", "StoreFull")]
    assert [(r.seq, r.delivered) for r in store.read_entries(1, 0, 10)] == [(2, True), (3, False)]
    assert store.read_message(kept[0]) is None
    assert store.read_entries(7, 0, 10) == []


# ---------------------------------------------------------------------- writer process


def test_batches_of_a_killed_writer_are_replayed_by_a_new_one(opened, loop):
    store = opened()
    mids = [put(store, 1, seq, b"m%d" % seq) for seq in range(1, 6)]
    assert commit(loop, store) is None
    store.delete_entry(1, 1)
    store.drop_message(mids[0])
    mids.append(put(store, 1, 6, b"m6"))
    store._handoff()                       # sent to the writer...
    first = store._writer.pid
    store._writer.kill()                   # ...which dies before (or after) committing it
    assert commit(loop, store) is None
    assert store._writer.pid != first
    assert [r.seq for r in store.read_entries(1, 0, 10)] == [2, 3, 4, 5, 6]
    assert store.read_message(mids[0]) is None and store.read_message(mids[5]) == b"m6"


def test_writers_that_keep_dying_leave_the_store_refusing(opened, loop):
    store = opened()
    for _ in range(4):
        put(store, 1, 1, b"x")
        store._handoff()
        store._writer.kill()
        store._writer.wait()
        loop.run_until_complete(asyncio.sleep(0.2))   # the loop notices the end of the pipe
    put(store, 1, 2, b"y")
    assert isinstance(commit(loop, store), StoreError)
    assert store.full
