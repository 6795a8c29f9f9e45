"""A healthy store is never refused at start (store/integrity.py), over many sizes and
shapes of real LMDB files written by py-lmdb, and the size check is exact: a file cut
to what the check says it needs reads back whole (LMDB itself walks it, in a child),
one page less is refused as truncated.

LMDB (without writemap) writes only the dirty pages still in use at commit: pages a
transaction took from the end of the file and gave back before it committed (a
value written then deleted, a split page merged again) count in the meta page's last
page but are never written, so the file can end before it.  They are on the free
list, and nothing reads them until they are used again (and written)."""

from __future__ import annotations

import shutil

import lmdb
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from amqpbroker.store.integrity import (
    DATA_FILE, HEADER_BYTES, StoreDamaged, check_header, file_pages, needed_size, preflight, write_marker,
)
from amqpbroker.store.verify import verify_in_child

VALUE_SIZES = [0, 10, 300, 1500, 5000, 20000]   # 5000 and 20000: overflow pages
OP = st.tuples(st.sampled_from(["put", "del"]), st.integers(0, 1), st.integers(0, 300), st.integers(1, 150),
               st.sampled_from(VALUE_SIZES))
TXN = st.tuples(st.lists(OP, min_size=1, max_size=6), st.booleans())    # (ops, aborted)
SHAPES = st.lists(TXN, min_size=1, max_size=25)

# The shortest shape found (by shrinking) whose file ends before the meta page's last
# page: five values of 1,500 bytes, four of them deleted by the next transaction.
UNWRITTEN_TAIL = [([("put", 0, 0, 1, 0)], False),
                  ([("put", 0, 0, 1, 0)] * 5 + [("put", 0, 0, 5, 1500)], False),
                  ([("del", 0, 0, 4, 0)], False)]


def build(path, txns, map_size: int = 64 << 20) -> None:
    """A store written by py-lmdb: two named databases, the transactions in order."""
    path.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(path), map_size=map_size, max_dbs=4)
    dbs = [env.open_db(b"a"), env.open_db(b"b")]
    for ops, aborted in txns:
        txn = env.begin(write=True)
        for kind, db, first, count, size in ops:
            for key in range(first, first + count):
                k = b"%08d" % (key * 7919 % 10007)
                if kind == "put":
                    txn.put(k, bytes([key % 251]) * size, db=dbs[db])
                else:
                    txn.delete(k, db=dbs[db])
        txn.abort() if aborted else txn.commit()
    env.close()


def check_file(data: bytes):
    return check_header(data[:HEADER_BYTES], len(data), lambda pgno, n, psize: data[pgno * psize:(pgno + n) * psize])


HYPOTHESIS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def test_a_store_whose_file_ends_before_its_last_page_starts(tmp_path):
    """The finding: a healthy store refused as "truncated".  Here its file is
    shorter than (last page + 1) x page size, reads clean, and starts."""
    build(tmp_path, UNWRITTEN_TAIL)
    env = lmdb.open(str(tmp_path), max_dbs=4, readonly=True)
    last, psize = env.info()["last_pgno"], env.stat()["psize"]
    env.close()
    size = (tmp_path / DATA_FILE).stat().st_size
    assert size < (last + 1) * psize, "the shape no longer leaves an unwritten tail: pick another"
    write_marker(tmp_path, psize)
    found = preflight(tmp_path)
    assert found.exists and found.meta.last_page == last
    assert verify_in_child(tmp_path).ok


@settings(HYPOTHESIS, max_examples=150)
@example(UNWRITTEN_TAIL)
@given(SHAPES)
def test_every_store_lmdb_writes_passes_the_start_up_checks(tmp_path_factory, txns):
    path = tmp_path_factory.mktemp("shape")
    try:
        build(path, txns)
        check_file((path / DATA_FILE).read_bytes())
        assert preflight(path).exists
    finally:
        shutil.rmtree(path)


@settings(HYPOTHESIS, max_examples=20)
@example(UNWRITTEN_TAIL)
@given(SHAPES)
def test_the_size_a_store_needs_is_exact(tmp_path_factory, txns):
    """Cut to `needed_size`, LMDB reads every record back (the walk in a child
    would die of SIGBUS on a page past the end); one page less is refused."""
    path = tmp_path_factory.mktemp("exact")
    try:
        build(path, txns)
        data = (path / DATA_FILE).read_bytes()
        meta = check_file(data)
        need = needed_size(meta, len(data), lambda pgno, n, psize: data[pgno * psize:(pgno + n) * psize])
        assert need <= len(data) and need % meta.page_size == 0
        with open(path / DATA_FILE, "r+b") as f:
            f.truncate(need)
        assert preflight(path).exists
        report = verify_in_child(path)
        assert report.ok, report.problems
        if need > 2 * meta.page_size:
            with open(path / DATA_FILE, "r+b") as f:
                f.truncate(need - meta.page_size)
            with pytest.raises(StoreDamaged, match="truncated"):
                preflight(path)
    finally:
        shutil.rmtree(path)


def test_file_pages_counts_whole_pages_only():
    assert file_pages(8192, 4096) == 2 and file_pages(8191, 4096) == 1
