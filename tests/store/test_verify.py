"""The walk over a whole store (store/verify.py), in this process and in the child
process the broker and `amqpbroker store check` use."""

from __future__ import annotations

import json
import random
import stat

import lmdb
import pytest

from amqpbroker.store.base import QueueRecord
from amqpbroker.store.batch import ENTRY_KEY, U64
from amqpbroker.store.integrity import StoreDamaged
from amqpbroker.store.lmdb_store import LmdbStore
from amqpbroker.store.verify import DBS, verify_in_child, walk
from tests.store.helpers import close, commit, put

BODY = b"\x00\x53\x70\x45\x00\x53\x75\xa0\x05hello"    # header (empty list) + data section


def populated(opened, loop, n: int = 50):
    store = opened()
    store.save_queue(QueueRecord("q", 1, "none", "permanent", None))
    store.save_exchange("ex", "topic")
    store.save_binding("ex", "k.#", "q", {})
    mids = [put(store, 1, seq, BODY) for seq in range(1, n + 1)]
    assert commit(loop, store) is None
    close(loop, store)
    return store.path, mids


def raw_put(path, db: str, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        handle = env.open_db(db.encode(), txn=txn)
        if value is None:
            txn.delete(key, db=handle)
        else:
            txn.put(key, value, db=handle)
    env.close()


def test_a_whole_store_walks_clean_with_counts_per_database(opened, loop):
    path, _ = populated(opened, loop)
    for full in (False, True):
        report = walk(path, full=full)
        assert report.ok, report.problems
        assert set(DBS) <= set(report.counts)
        assert report.counts["messages"] == 50 and report.counts["entries"] == 50
        assert report.counts["queues"] == 1 and report.counts["bindings"] == 1
    child = verify_in_child(path, full=True)
    assert child.ok and child.counts == walk(path, full=True).counts


@pytest.mark.parametrize("db,key,value,expected", [
    ("queues", b"q", b"{not json", "database queues: record b'q' cannot be decoded: JSONDecodeError"),
    ("queues", b"q", json.dumps({"name": "q"}).encode(), "TypeError"),
    ("entries", ENTRY_KEY.pack(1, 7), b"short", "database entries: record"),
    ("messages", U64.pack(2), b"\xff\xff garbage", "database messages: record"),
    ("subscriptions", b"s", b"[]", "database subscriptions"),
], ids=["json", "queue-fields", "entry", "message", "subscription"])
def test_a_record_the_broker_could_not_decode_is_a_problem_of_the_full_check(opened, loop, db, key, value,
                                                                               expected):
    path, _ = populated(opened, loop)
    raw_put(path, db, key, value)
    assert walk(path, full=False).ok, "the quick walk reads pages, it does not decode"
    report = walk(path, full=True)
    assert not report.ok
    assert any(expected in p for p in report.problems), report.problems


def test_entries_of_missing_messages_are_problems_and_orphans_are_notes(opened, loop):
    path, mids = populated(opened, loop, 5)
    raw_put(path, "messages", U64.pack(mids[0]), None)          # entry 1 now points at nothing
    raw_put(path, "messages", U64.pack(999), BODY)              # nothing points at this one
    raw_put(path, "meta", b"next_msg_id", U64.pack(1000))
    report = walk(path, full=True)
    assert report.problems == [f"database entries: 1 entry refers to missing messages, e.g. queue 1 "
                               f"message {mids[0]}"]
    assert any("1 message(s) no entry refers to" in n for n in report.notes)


def test_a_checker_killed_by_a_signal_is_a_damaged_store(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -BUS $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("sys.executable", str(fake))
    report = verify_in_child(tmp_path)
    assert not report.ok
    assert report.problems == ["reading the store killed the checking process with SIGBUS: pages of "
                               "data.mdb are damaged (they point outside the file)"]


def damage_data_pages(path, seed: int) -> None:
    """Garbage over every page but the two meta pages."""
    data = path / "data.mdb"
    size = data.stat().st_size
    rng = random.Random(seed)
    with open(data, "r+b") as f:
        f.seek(8192)
        f.write(bytes(rng.getrandbits(8) for _ in range(size - 8192)))


def test_garbage_data_pages_fail_the_walk_and_the_open_without_killing_this_process(opened, loop):
    path, _ = populated(opened, loop, 300)
    damage_data_pages(path, 1)
    report = verify_in_child(path)
    assert not report.ok and report.problems
    with pytest.raises(StoreDamaged, match=r"store at .* is damaged: .*amqpbroker store check --data-dir"):
        LmdbStore(path).open(loop)
    # The failed open released the lock: a repaired store could be opened at once.
    from amqpbroker.store.lock import StoreLock
    lock = StoreLock(path)
    lock.acquire(dead_holder_wait=0)
    lock.release()
