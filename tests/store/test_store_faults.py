"""Faults on the way to the disk, injected at each step (store/faults.py) into a
real LmdbStore, its real writer process and a real LMDB: a batch that is not
committed is never reported committed, its new entries are reported lost, what
it removes still reaches the disk, the store is degraded (one log line) while
the fault lasts and resumes after it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from amqpbroker.store.base import StoreFault, StoreFull
from amqpbroker.store.faults import ENV, Faults, FaultSpecError
from tests.store.helpers import close, commit, put, queue_record, reopen

STORE_LOG = "amqpbroker.store"


def arm(store, spec: str) -> None:
    """Broker-side faults of an open store (the writer reads AMQPBROKER_STORE_FAULTS
    itself, at its start)."""
    store._faults = store._outbox.faults = Faults.parse(spec)


def run_until(loop, predicate, timeout: float = 20.0) -> None:
    async def wait():
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached")
            await asyncio.sleep(0.01)
    loop.run_until_complete(wait())


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def stored_with_an_acknowledgement(store, loop):
    """Two committed entries; then, in the batch that will fail: the first one
    acknowledged (entry and message removed) and a new entry (seq 3)."""
    kept = [put(store, 1, seq, b"k%d" % seq) for seq in (1, 2)]
    assert commit(loop, store) is None
    lost: list = []
    store.on_lost_entries = lost.extend
    store.delete_entry(1, 1)
    store.drop_message(kept[0])
    new = put(store, 1, 3, b"new")
    return kept, new, lost


def assert_only_the_removal_reached_the_disk(store, kept, new):
    assert [r.seq for r in store.read_entries(1, 0, 10)] == [2]
    assert store.read_message(kept[0]) is None, "the acknowledgement was committed all the same"
    assert store.read_message(new) is None, "the rejected message is not in the store"


# ---------------------------------------------------------------------- broker side


@pytest.mark.parametrize("point", ["seal", "encode"])
def test_a_batch_that_cannot_be_handed_over_fails_alone_and_the_store_resumes(opened, loop, caplog, point):
    caplog.set_level(logging.INFO, STORE_LOG)
    store = opened()
    kept, new, lost = stored_with_an_acknowledgement(store, loop)
    arm(store, f"{point}:MemoryError@0*1")
    error = commit(loop, store)
    assert isinstance(error, StoreFault) and "MemoryError" in str(error)
    assert lost == [(1, 3)], "its new entry is reported lost before the callbacks run"
    assert store.degraded is not None and store.full, "durable messages are refused meanwhile"
    assert store.failed_batches == 1
    assert commit(loop, store) is None, "the next batch is stored"
    assert store.degraded is None and not store.full
    assert_only_the_removal_reached_the_disk(store, kept, new)
    assert len(lines(caplog, "degraded")) == 1 and len(lines(caplog, "recovered after")) == 1
    assert str(store.path) in lines(caplog, "degraded")[0]


def test_a_pipe_write_error_fails_the_unwritten_batches_and_writing_resumes(opened, loop, caplog):
    caplog.set_level(logging.INFO, STORE_LOG)
    store = opened()
    kept, new, lost = stored_with_an_acknowledgement(store, loop)
    arm(store, "pipe-write:ENOSPC@0*1")
    error = commit(loop, store)
    assert isinstance(error, StoreFault) and "No space left on device" in str(error)
    assert lost == [(1, 3)]
    assert store.degraded is not None
    assert commit(loop, store) is None, "writing resumes after the retry delay"
    assert store.degraded is None
    assert_only_the_removal_reached_the_disk(store, kept, new)
    assert len(lines(caplog, "degraded")) == 1


def test_a_broken_pipe_replaces_the_writer_and_loses_nothing(opened, loop, caplog):
    caplog.set_level(logging.INFO, STORE_LOG)
    store = opened()
    first = store._writer.pid
    arm(store, "pipe-write:EPIPE@0*1")
    mid = put(store, 1, 1, b"replayed")
    assert commit(loop, store) is None
    assert store._writer.pid != first
    assert store.read_message(mid) == b"replayed"
    assert lines(caplog, "store writer process lost")


def test_a_failed_result_read_replays_and_reports_each_batch_once(opened, loop, caplog):
    """The results cannot be trusted after a failed read (which commits were they?):
    a new writer replays every batch not reported committed; each callback runs once."""
    caplog.set_level(logging.INFO, STORE_LOG)
    store = opened()
    first = store._writer.pid
    arm(store, "results:EIO@0*1")
    calls = []
    mids = [put(store, 1, seq, b"m%d" % seq) for seq in (1, 2, 3)]
    store.after_commit(calls.append)
    assert commit(loop, store) is None
    assert calls == [None]
    assert store._writer.pid != first
    assert [store.read_message(m) for m in mids] == [b"m1", b"m2", b"m3"]
    assert not store.degraded


def test_the_outbox_stays_bounded_while_the_writer_does_not_read(opened, loop):
    """A stalled writer: batches wait as they are (not pickled) once the outbox holds
    its limit; nothing is lost, everything commits once the writer goes on."""
    store = opened()
    store._outbox.limit = 256 << 10
    body = b"P" * (64 << 10)
    done: list = []
    os.kill(store._writer.pid, signal.SIGSTOP)
    try:
        for seq in range(1, 61):          # 3.8 MiB: more than the pipe and the outbox take
            put(store, 1, seq, body)
            store.after_commit(done.append)
            store._handoff()
        assert store.outbox_bytes <= store._outbox.limit + len(body) + 4096
        assert len(store._unsent) > 0, "the rest waits unframed"
        assert store.pending_batches == 60
    finally:
        os.kill(store._writer.pid, signal.SIGCONT)
    run_until(loop, lambda: len(done) == 60)
    assert done == [None] * 60
    assert store.count_entries(1) == 60 and store.pending_batches == 0
    assert store._outbox.peak <= store._outbox.limit + len(body) + 4096


def test_writers_that_keep_dying_degrade_the_store_until_a_new_one_works(opened, loop, caplog):
    caplog.set_level(logging.INFO, STORE_LOG)
    store = opened()
    store._backoff = 0.2
    for seq in range(1, 5):
        put(store, 1, seq, b"x")
        store._handoff()
        writer = store._writer
        writer.kill()
        writer.wait()
        run_until(loop, lambda w=writer: store._writer is not w)
    assert store._writer is None and store.degraded and store.full
    assert isinstance(commit(loop, store), StoreFault), "refused at once while no writer runs"
    run_until(loop, lambda: store._writer is not None)      # started again after the back-off
    assert commit(loop, store) is None
    assert store.degraded is None and not store.full
    assert len(lines(caplog, "durable messages are refused; a new writer in")) == 1
    assert lines(caplog, "recovered after")


def test_an_unexpected_error_in_a_store_callback_never_escapes_to_the_loop(opened, loop, caplog):
    """The last net around the loop callbacks: no "Exception in callback"; the batch
    handed over before the failure still commits, and the store resumes."""
    caplog.set_level(logging.INFO, STORE_LOG)
    escaped: list = []
    loop.set_exception_handler(lambda _loop, context: escaped.append(context))
    store = opened()
    real_pump = store._pump
    calls = []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        real_pump()

    store._pump = broken_once
    mid = put(store, 1, 1, b"still stored")
    assert commit(loop, store) is None
    assert store.read_message(mid) == b"still stored"
    run_until(loop, lambda: store.degraded is None)
    assert escaped == []
    assert lines(caplog, "handing a batch over failed"), "a bug gets its traceback, once"


# ---------------------------------------------------------------------- writer process side


def test_a_commit_that_fails_in_the_writer_is_reported_and_its_removals_still_commit(
        tmp_path, loop, monkeypatch, caplog):
    caplog.set_level(logging.INFO, STORE_LOG)
    monkeypatch.setenv(ENV, "commit:EIO@1*1")      # the writer's second commit fails
    from amqpbroker.store.lmdb_store import LmdbStore
    store = LmdbStore(tmp_path / "store")
    store.open(loop)
    try:
        kept, new, lost = stored_with_an_acknowledgement(store, loop)
        error = commit(loop, store)
        assert isinstance(error, StoreFault) and "commit failed in the store writer process" in str(error)
        assert "Input/output error" in str(error)
        assert lost == [(1, 3)]
        assert store.degraded is not None
        assert commit(loop, store) is None
        assert store.degraded is None
        assert_only_the_removal_reached_the_disk(store, kept, new)
    finally:
        store.close()


def _fail_with_a_queue_made_in_the_batch(store, loop):
    """A batch that makes queue 5 (its record), acknowledges a stored message and adds
    one: its commit fails and so does the write of its leftovers (the disk still
    full), so the writer carries them to its next commit."""
    kept = put(store, 1, 1, b"acknowledged in the failed batch")
    assert commit(loop, store) is None
    store.save_queue(queue_record("made-in-the-failed-batch", 5))
    store.delete_entry(1, 1)
    store.drop_message(kept)
    put(store, 1, 2, b"refused")
    assert isinstance(commit(loop, store), StoreFull)
    timer = store._timers.pop("probe", None)   # no probe commit: the carry stays in the writer for now
    if timer is not None:
        timer.cancel()
    return kept


@pytest.mark.parametrize("then", ["writer killed", "clean stop"])
def test_what_a_failed_commit_still_had_to_write_survives_the_writer(tmp_path, loop, monkeypatch, caplog,
                                                                     then):
    """A failed commit whose removals and entity records could not be written either
    leaves them in the writer's memory until its next commit.  A writer killed before
    that (out of memory, by hand) took them with it: the new writer committed what the
    broker stored next under queue 5, without queue 5's record, and a restart dropped
    it.  The broker keeps such batches until a later commit and replays them first;
    a writer told to stop writes them before it closes the store."""
    caplog.set_level(logging.INFO, STORE_LOG)
    monkeypatch.setenv(ENV, "commit:DiskError@1*1,removals:DiskError@0*1")
    from amqpbroker.store.lmdb_store import LmdbStore
    store = LmdbStore(tmp_path / "store")
    store.open(loop)
    try:
        kept = _fail_with_a_queue_made_in_the_batch(store, loop)
        if then == "writer killed":
            first = store._writer.pid
            os.kill(first, signal.SIGKILL)
            run_until(loop, lambda: store._writer is not None and store._writer.pid != first)
            stored = put(store, 5, 1, b"accepted under queue 5")
            assert commit(loop, store) is None
        store, snap = reopen(loop, store)
        assert "made-in-the-failed-batch" in [q.name for q in snap.queues]
        assert store.read_message(kept) is None, "the acknowledgement reached the disk"
        if then == "writer killed":
            assert [r.seq for r in store.read_entries(5, 0, 10)] == [1]
            assert store.read_message(stored) == b"accepted under queue 5"
    finally:
        close(loop, store)


def test_a_result_the_writer_cannot_write_back_is_replayed_not_lost(tmp_path, loop, monkeypatch, caplog):
    caplog.set_level(logging.INFO, STORE_LOG)
    monkeypatch.setenv(ENV, "result-write:EPIPE@1*1")   # the second result of the first writer
    from amqpbroker.store.lmdb_store import LmdbStore
    store = LmdbStore(tmp_path / "store")
    store.open(loop)
    try:
        assert commit(loop, store) is None
        first = store._writer.pid
        calls = []
        mid = put(store, 1, 1, b"committed, not reported")
        store.after_commit(calls.append)
        assert commit(loop, store) is None
        assert calls == [None]
        assert store._writer.pid != first
        assert store.read_message(mid) == b"committed, not reported"
        assert lines(caplog, "store writer process lost")
    finally:
        store.close()


# ---------------------------------------------------------------------- the spec


def test_fault_specs_count_calls_and_name_their_errors():
    faults = Faults.parse("encode:MemoryError@2*2, pipe-write:EPIPE, commit:MapFullError@0*inf")
    outcomes = []
    for _ in range(5):
        try:
            faults.check("encode")
            outcomes.append("ok")
        except MemoryError:
            outcomes.append("fail")
    assert outcomes == ["ok", "ok", "fail", "fail", "ok"]
    with pytest.raises(BrokenPipeError):
        faults.check("pipe-write")
    faults.check("pipe-write")   # once only
    import lmdb
    for _ in range(3):
        with pytest.raises(lmdb.MapFullError):
            faults.check("commit")
    faults.check("seal")   # not armed
    for bad in ("nowhere:MemoryError", "encode:NoSuchError", "encode@x"):
        with pytest.raises(FaultSpecError):
            Faults.parse(bad)
    assert Faults.from_env({}) is None and Faults.from_env({ENV: " "}) is None
