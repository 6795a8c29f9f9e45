"""The journal in front of LMDB (store/journal.py, store/writer.py): one fdatasync per
group commit, LMDB without syncs, checkpoints, and what a system crash can leave.

A system crash cannot be had in a test; what it can leave on disk can.  The writer
runs in this process (its Writer class, the real LMDB, the real journal file); a
"crash image" is then written into data.mdb in place (same inode): the file as it
was at the last checkpoint, with the meta pages of the latest commits.  That is the
worst case of MDB_NOSYNC: the kernel wrote the meta pages and none of the pages they
point to."""

from __future__ import annotations

import logging
import os
import shutil

import lmdb
import pytest

from amqpbroker.store import journal as journal_mod
from amqpbroker.store import writer as writer_proc
from amqpbroker.store.base import EntryRecord
from amqpbroker.store.batch import Batch
from amqpbroker.store.faults import Faults
from amqpbroker.store.journal import RECORDS_AT, Journal
from amqpbroker.store.verify import walk

MAP = 64 << 20


def batch(puts: dict[int, bytes] = {}, drops: tuple[int, ...] = ()) -> Batch:
    b = Batch()
    for mid, raw in puts.items():
        b.put_message(mid, raw)
        b.put_entry(1, EntryRecord(mid, mid, 0, size=len(raw)))
    for mid in drops:
        b.drop_message(mid)
        b.delete_entry(1, mid)
    return b.seal()


def commit(w: writer_proc.Writer, *batches: Batch) -> None:
    frames = [writer_proc.frame(("batch", n, writer_proc.batch_fields(b))) for n, b in enumerate(batches)]
    assert w.commit(list(batches), frames) == (None, None)


def stored(path, env=None) -> dict[int, bytes]:
    """The messages in the store at `path` (through LMDB, as a broker reads them), or
    through the open `env`."""
    own = env is None
    env = env or lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            db = env.open_db(b"messages", txn=txn, create=False)
            return {int.from_bytes(k, "big"): bytes(v) for k, v in txn.cursor(db=db)}
    finally:
        if own:
            env.close()


def crash(w: writer_proc.Writer, path, at_checkpoint: bytes, written: str = "metas") -> None:
    """The writer dies (no checkpoint); data.mdb becomes what a system crash can leave
    of the writes since the checkpoint: `written` = "metas", the kernel wrote the
    meta pages and none of the pages they point to (what makes MDB_NOSYNC unsafe
    alone); "pages", it wrote every other page and not the meta pages (what a
    checkpoint whose pages were reused would not survive)."""
    psize = w.env.stat()["psize"]
    latest = (path / "data.mdb").read_bytes()
    w.pin.abort()
    w.env.close()
    w.journal.close()
    if written == "metas":
        image = bytearray(latest)
        image[2 * psize:len(at_checkpoint)] = at_checkpoint[2 * psize:]
        image[len(at_checkpoint):] = bytes(len(latest) - len(at_checkpoint))   # never written
    else:
        image = bytearray(at_checkpoint[:2 * psize] + latest[2 * psize:])
    with open(path / "data.mdb", "r+b") as f:                             # same inode
        f.write(image)


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.mark.parametrize("written", ["metas", "pages"])
def test_a_system_crash_image_loses_no_journaled_commit(store_dir, written):
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    commit(w, batch({n: b"v0-%d" % n * 50 for n in range(1, 60)}))
    w.checkpoint()
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    for version in range(1, 25):              # rewrite every page many times over: LMDB
        rewrite = Batch()                     # reuses freed pages unless a reader pins them
        for n in range(1, 60):
            rewrite.put_message(n, b"v%d-%d" % (version, n) * 50)
        commit(w, rewrite.seal())
    commit(w, batch({100: b"new" * 100}, drops=(1, 2, 3)))
    expected = {**{n: b"v24-%d" % n * 50 for n in range(4, 60)}, 100: b"new" * 100}
    assert stored(store_dir, w.env) == expected
    crash(w, store_dir, at_checkpoint, written)
    try:                               # what LMDB alone makes of it
        naive = stored(store_dir)
    except lmdb.Error:
        naive = None
    if written == "metas":
        assert naive != expected, "the meta pages point at pages that were never written"
    assert writer_proc.recover(store_dir) == 25, "the journaled batches, applied again"
    assert stored(store_dir) == expected
    report = walk(store_dir)               # every page of every database readable
    assert report.ok and report.counts["messages"] == len(expected), report.problems
    assert Journal.open(store_dir).used == 0, "a checkpoint after recovery: nothing to apply again"


def test_a_torn_last_record_is_not_applied_and_the_ones_before_it_are(store_dir):
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({1: b"a" * 500}))
    commit(w, batch({2: b"b" * 500}))
    torn_at = w.journal.position
    commit(w, batch({3: b"c" * 500}))
    end = w.journal.position
    crash(w, store_dir, at_checkpoint)
    with open(store_dir / journal_mod.FILE, "r+b") as f:    # the last append only half written
        f.seek(torn_at + (end - torn_at) // 2)
        f.write(bytes(end - f.tell()))
    assert writer_proc.recover(store_dir) == 2
    assert sorted(stored(store_dir)) == [1, 2]


def test_records_left_from_before_a_checkpoint_are_never_applied(store_dir):
    """The file is reused in place: after a checkpoint, the older epoch's records lie
    beyond the new tail until overwritten."""
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    commit(w, batch({1: b"x" * 300}))
    for mid in range(2, 40):
        commit(w, batch({mid: b"y" * 300}))
    commit(w, batch(drops=tuple(range(2, 40))))
    w.checkpoint()
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({50: b"z" * 300}))       # one record of the new epoch, then the old ones
    crash(w, store_dir, at_checkpoint)
    assert writer_proc.recover(store_dir) == 1
    assert sorted(stored(store_dir)) == [1, 50], "the dropped messages' old records stayed unread"


def test_a_clean_stop_leaves_nothing_to_apply_again(store_dir):
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    commit(w, batch({1: b"kept"}))
    w.close()
    journal, records = journal_mod.restore(store_dir)
    journal.close()
    assert records == []
    assert stored(store_dir) == {1: b"kept"}


def test_a_journal_of_a_replaced_data_file_is_not_applied(store_dir, tmp_path, caplog):
    """A copy put in place of data.mdb (a restored backup, a replica's copy) is
    authoritative: the journal of the file it replaced is stale."""
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    commit(w, batch({1: b"in the copy"}))
    w.checkpoint()
    copy = tmp_path / "copy.mdb"
    shutil.copyfile(store_dir / "data.mdb", copy)
    commit(w, batch({2: b"journaled for the old file"}))
    w.pin.abort()
    w.env.close()
    w.journal.close()
    os.replace(copy, store_dir / "data.mdb")
    caplog.set_level(logging.INFO, "amqpbroker.store")
    assert writer_proc.recover(store_dir) == 0
    assert stored(store_dir) == {1: b"in the copy"}
    assert any("belongs to another data.mdb" in r.getMessage() for r in caplog.records)


def test_a_group_larger_than_the_journal_is_made_durable_by_a_checkpoint(store_dir, monkeypatch):
    monkeypatch.setattr(journal_mod, "SIZE", RECORDS_AT + (64 << 10))
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    epoch = w.journal.current.epoch
    commit(w, batch({1: b"B" * (200 << 10)}))
    assert w.journal.current.epoch > epoch and w.journal.used == 0
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    crash(w, store_dir, at_checkpoint)
    writer_proc.recover(store_dir)
    assert stored(store_dir) == {1: b"B" * (200 << 10)}


def test_the_journal_checkpoints_when_half_full(store_dir, monkeypatch):
    monkeypatch.setattr(journal_mod, "SIZE", RECORDS_AT + (256 << 10))
    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    assert w.journal.checkpoint_at == 128 << 10
    for mid in range(1, 100):
        commit(w, batch({mid: b"h" * 4000}))
        assert w.journal.fits(4200) or w.journal.used >= w.journal.checkpoint_at
    assert w.journal.used < w.journal.size


def test_a_commit_whose_journal_write_fails_raises_and_is_not_reported(store_dir):
    """Nothing may be reported then: the writer process exits and the broker replays
    the batch to a new writer (tests/store/test_store_faults.py: writer lost)."""
    w = writer_proc.Writer(str(store_dir), MAP, MAP, faults=Faults.parse("journal:EIO@1*1"))
    commit(w, batch({1: b"ok"}))
    b = batch({2: b"not journaled"})
    with pytest.raises(OSError):
        w.commit([b], [writer_proc.frame(("batch", 1, writer_proc.batch_fields(b)))])


@pytest.mark.parametrize("error", ["EIO", "MemoryError"])
@pytest.mark.parametrize("removals", ["written", "fail too"])
def test_a_failed_transactions_record_is_taken_back(store_dir, monkeypatch, error, removals):
    """The journal record is written before the LMDB transaction (its write-back then
    runs beside it).  A transaction that fails is reported failed, so its record must
    never be applied, whether the failed batch's removals are journaled in its place
    or cannot be (then nothing else overwrites it): it is zeroed before the result."""
    w = writer_proc.Writer(str(store_dir), MAP, MAP, faults=Faults.parse(f"commit:{error}@1*1"))
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({1: b"before" * 50}))
    failed = batch({2: b"reported failed" * 50}, drops=(1,))
    if removals == "fail too":
        monkeypatch.setattr(Batch, "removals_only", lambda self: (_ for _ in ()).throw(MemoryError()))
    kind, _ = w.commit([failed], [writer_proc.frame(("batch", 1, writer_proc.batch_fields(failed)))])
    assert kind == "error"
    expected = {} if removals == "written" else {1: b"before" * 50}
    assert stored(store_dir, w.env) == expected
    crash(w, store_dir, at_checkpoint)
    writer_proc.recover(store_dir)
    assert stored(store_dir) == expected


def test_records_after_a_taken_back_one_are_applied(store_dir):
    w = writer_proc.Writer(str(store_dir), MAP, MAP, faults=Faults.parse("commit:EIO@1*1"))
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({1: b"before" * 50}))
    failed = batch({2: b"reported failed" * 50}, drops=(1,))
    assert w.commit([failed], [writer_proc.frame(("batch", 1, writer_proc.batch_fields(failed)))])[0] == "error"
    commit(w, batch({3: b"after" * 50}))
    crash(w, store_dir, at_checkpoint)
    assert writer_proc.recover(store_dir) == 3, "the first batch, the failed one's removals, the third"
    assert stored(store_dir) == {3: b"after" * 50}


def queue_records(path, env=None) -> set[bytes]:
    own = env is None
    env = env or lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor(db=env.open_db(b"queues", txn=txn, create=False))}
    finally:
        if own:
            env.close()


def test_what_a_failed_commit_must_still_write_goes_into_the_next_commit_when_it_cannot_at_once(
        store_dir, monkeypatch):
    """A failed commit still writes its removals and entity records (the broker made
    that queue in memory, and stores what it accepts next under it).  When that
    write fails too (the disk still full), the next commit applies it first, in the
    same transaction and journal record: nothing after it is ever on disk without it."""
    w = writer_proc.Writer(str(store_dir), MAP, MAP, faults=Faults.parse("commit:DiskError@1*1"))
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({1: b"before" * 50}))
    failed = Batch()
    failed.put_message(2, b"refused" * 50)
    failed.put_entry(1, EntryRecord(2, 2, 0))
    failed.drop_message(1)
    failed.delete_entry(1, 1)
    failed.put_meta("put", "queues", b"made-in-memory", b"{}")
    failed.seal()
    real_apply, fail_next = Batch.apply, [True]

    def apply(self, txn, dbs):   # the removals' own transaction fails once (inside the commit's is the fault)
        if fail_next[0]:
            fail_next[0] = False
            raise lmdb.DiskError("still full")
        real_apply(self, txn, dbs)

    monkeypatch.setattr(Batch, "apply", apply)
    assert w.commit([failed], [writer_proc.frame(("batch", 1, writer_proc.batch_fields(failed)))])[0] == "full"
    assert len(w.carry) == 1 and queue_records(store_dir, w.env) == set()
    commit(w, batch({3: b"after" * 50}))
    assert w.carry == []
    assert stored(store_dir, w.env) == {3: b"after" * 50}
    assert queue_records(store_dir, w.env) == {b"made-in-memory"}
    crash(w, store_dir, at_checkpoint)
    writer_proc.recover(store_dir)
    assert stored(store_dir) == {3: b"after" * 50}
    assert queue_records(store_dir) == {b"made-in-memory"}


def test_store_check_applies_what_a_crash_left_in_the_journal_first(store_dir):
    """`amqpbroker store check` on a stopped broker's store looks at it as the broker's
    next start would: with the journal applied."""
    import io

    from amqpbroker.store import tool

    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    at_checkpoint = (store_dir / "data.mdb").read_bytes()
    commit(w, batch({7: b"only in the journal"}))
    crash(w, store_dir, at_checkpoint)
    out = io.StringIO()
    assert tool.apply_journal(store_dir, out) is None
    assert "applied 1 batch(es) left in the store's journal" in out.getvalue()
    assert stored(store_dir) == {7: b"only in the journal"}


def test_a_checkpoint_extends_a_data_file_that_ends_before_its_last_counted_page(store_dir):
    """LMDB does not write a page it allocated and freed in the same transaction, so
    data.mdb can end before the last page its meta page counts; the checkpoint extends
    it (zeros: free pages) so that the start-up check does not take it for a truncated
    file."""
    import struct

    from amqpbroker.store.integrity import preflight

    w = writer_proc.Writer(str(store_dir), MAP, MAP)
    commit(w, batch({1: b"x" * 1000}))
    w.close()
    data = store_dir / "data.mdb"
    raw = bytearray(data.read_bytes())
    psize = 4096
    for page in (0, 1):                      # both meta pages count two more pages
        at = page * psize + 136
        struct.pack_into("=Q", raw, at, struct.unpack_from("=Q", raw, at)[0] + 2)
    data.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="truncated"):
        preflight(store_dir)
    w = writer_proc.Writer(str(store_dir), MAP, MAP)   # its first checkpoint
    w.close()
    assert preflight(store_dir).exists
    assert stored(store_dir) == {1: b"x" * 1000}
