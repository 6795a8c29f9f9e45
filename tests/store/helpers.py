"""Helpers for LmdbStore tests (a real LMDB in tmp_path, a real asyncio loop); the
`loop` and `opened` fixtures are in conftest.py."""

from __future__ import annotations

import asyncio

from amqpbroker.store.base import EntryRecord, QueueRecord
from amqpbroker.store.lmdb_store import LmdbStore


def close(loop, store: LmdbStore) -> None:
    if store.env is not None:   # open (its writer may be down: still closed, the lock released)
        store.close()


def commit(loop, store: LmdbStore, timeout: float = 20.0):
    """Queue an after_commit callback and run the loop until it fires; its error."""
    fut = loop.create_future()
    store.after_commit(lambda err: fut.set_result(err))
    return loop.run_until_complete(asyncio.wait_for(fut, timeout))


def reopen(loop, store: LmdbStore, **kw) -> tuple[LmdbStore, object]:
    close(loop, store)
    again = LmdbStore(store.path, map_size=kw.pop("map_size", store.initial_map_size),
                      max_map_size=kw.pop("max_map_size", store.max_map_size))
    snap = again.open(loop)
    return again, snap


def entry(seq: int, msg_id: int, **kw) -> EntryRecord:
    return EntryRecord(seq, msg_id, kw.pop("delivery_count", 0), **kw)


def put(store: LmdbStore, queue_id: int, seq: int, raw: bytes) -> int:
    mid = store.new_msg_id()
    store.put_message(mid, raw)
    store.put_entry(queue_id, entry(seq, mid, size=len(raw)))
    return mid


def queue_record(name: str, queue_id: int) -> QueueRecord:
    return QueueRecord(name, queue_id, "none", "permanent", None)
