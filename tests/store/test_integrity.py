"""What is checked before LMDB maps a store (store/integrity.py): LMDB's meta page
layout, pinned against stores py-lmdb writes, and the verdicts on damaged files,
made on bytes without LMDB."""

from __future__ import annotations

import json
import struct

import lmdb
import pytest

from amqpbroker.store.integrity import (
    DATA_FILE, HEADER_BYTES, MARKER, Meta, StoreDamaged, check_header, parse_meta, preflight, read_marker,
    write_marker,
)

KiB = 1 << 10


def make_store(path, records: int = 300, value: bytes = b"v" * 200, map_size: int = 8 << 20) -> dict:
    """A store written by py-lmdb; what LMDB itself says about it."""
    env = lmdb.open(str(path), map_size=map_size, max_dbs=4)
    db = env.open_db(b"things")
    for start in range(0, records, 100):   # several transactions
        with env.begin(write=True) as txn:
            for i in range(start, min(start + 100, records)):
                txn.put(b"%08d" % i, value, db=db)
    facts = dict(env.info(), psize=env.stat()["psize"])
    env.close()
    return facts


def head_of(path) -> tuple[bytes, int]:
    data = (path / DATA_FILE).read_bytes()
    return data[:HEADER_BYTES], len(data)


# ---------------------------------------------------------------------- the layout


@pytest.mark.parametrize("records,value", [(0, b""), (300, b"v" * 200), (50, b"big" * 5000)],
                         ids=["empty", "small-values", "overflow-pages"])
def test_meta_page_layout_matches_what_lmdb_reports(tmp_path, records, value):
    facts = make_store(tmp_path, records, value)
    head, size = head_of(tmp_path)
    meta = check_header(head, size)
    assert meta.txnid == facts["last_txnid"]
    assert meta.last_page == facts["last_pgno"]
    assert meta.page_size == facts["psize"]
    assert meta.map_size == facts["map_size"]
    assert meta.needed_bytes <= size
    # Both meta pages parse; the other one is one transaction older (LMDB alternates).
    psize = meta.page_size
    pages = [parse_meta(head[:psize], 0), parse_meta(head[psize:2 * psize], 1, psize)]
    assert {p.txnid for p in pages} == {facts["last_txnid"], facts["last_txnid"] - 1}
    assert meta == max(pages, key=lambda p: p.txnid)


def test_a_grown_map_is_recorded_in_the_newest_meta_page(tmp_path):
    make_store(tmp_path, 10, map_size=1 << 20)
    env = lmdb.open(str(tmp_path), map_size=1 << 20, max_dbs=4)
    env.set_mapsize(4 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v" * 1000, db=env.open_db(b"things", txn=txn))
    env.close()
    assert check_header(*head_of(tmp_path)).map_size == 4 << 20


def test_the_file_written_by_lmdb_is_exactly_the_pages_it_uses(tmp_path):
    """LMDB (without writemap) writes every page up to the last one in use when no
    transaction gave pages back before committing (only puts here); otherwise the
    file may end before it (tests/store/test_store_sizes.py)."""
    facts = make_store(tmp_path, 2000)
    _, size = head_of(tmp_path)
    assert size == (facts["last_pgno"] + 1) * facts["psize"]


# ---------------------------------------------------------------------- damaged bytes


@pytest.fixture
def whole(tmp_path) -> tuple[bytes, int, Meta]:
    make_store(tmp_path, 1000)
    head, size = head_of(tmp_path)
    return head, size, check_header(head, size)


def test_a_file_shorter_than_its_meta_page_says_is_truncated(whole):
    head, size, meta = whole
    for short in (size // 2, 2 * meta.page_size, meta.needed_bytes - 1):
        with pytest.raises(StoreDamaged, match="truncated") as err:
            check_header(head, short)
        assert f"records {meta.last_page + 1} pages" in str(err.value)


@pytest.mark.parametrize("size", [1, 100, 1023, 4095])
def test_a_file_too_short_for_two_meta_pages_is_truncated(whole, size):
    head, _, _ = whole
    with pytest.raises(StoreDamaged, match="too short .* meta pages.*truncated"):
        check_header(head[:size], size)


@pytest.mark.parametrize("page", [0, 1])
def test_garbage_over_a_meta_page_is_named(whole, page):
    head, size, meta = whole
    psize = meta.page_size
    bad = bytearray(head)
    bad[page * psize:(page + 1) * psize] = bytes((i * 37 + 11) & 0xFF for i in range(psize))
    with pytest.raises(StoreDamaged, match=f"meta page {page} of data.mdb is not an LMDB meta page"):
        check_header(bytes(bad), size)


@pytest.mark.parametrize("offset,fmt,value,reason", [
    (10, "=H", 0x01, r"damaged .page number \d, flags 0x1"),      # flags without P_META
    (0, "=Q", 7, "damaged .page number 7"),                      # page number
    (20, "=I", 999, "data version 999"),
    (40, "=I", 3000, "page size 3000"),
    (136, "=Q", 1 << 40, "last page"),                          # beyond its map size
    (128, "=Q", 1 << 40, "main database root"),
], ids=["flags", "pgno", "version", "page-size", "last-page", "main-root"])
def test_inconsistent_meta_fields_are_refused(whole, offset, fmt, value, reason):
    head, size, meta = whole
    bad = bytearray(head)
    # damage the newest meta page, the one LMDB would use
    struct.pack_into(fmt, bad, meta.page * meta.page_size + offset, value)
    with pytest.raises(StoreDamaged, match=reason):
        check_header(bytes(bad), size)


def test_the_newer_meta_page_decides_the_size_needed(whole):
    head, size, meta = whole
    older = 1 - meta.page
    bad = bytearray(head)
    # The older page claims a later transaction and a last page past the end.
    struct.pack_into("=QQ", bad, older * meta.page_size + 136, meta.last_page + 10, meta.txnid + 1)
    with pytest.raises(StoreDamaged, match=f"meta page {older} .transaction {meta.txnid + 1}"):
        check_header(bytes(bad), size)


# ---------------------------------------------------------------------- the marker


def test_no_data_file_and_no_marker_is_a_new_store(tmp_path):
    assert preflight(tmp_path).exists is False
    (tmp_path / DATA_FILE).write_bytes(b"")
    assert preflight(tmp_path).exists is False   # created, never committed


def test_a_vanished_or_emptied_data_file_with_the_marker_is_refused(tmp_path):
    make_store(tmp_path)
    write_marker(tmp_path, 4096)
    assert preflight(tmp_path).exists is True
    (tmp_path / DATA_FILE).write_bytes(b"")
    with pytest.raises(StoreDamaged, match=r"is empty \(0 bytes\) but store.state says this directory held"):
        preflight(tmp_path)
    (tmp_path / DATA_FILE).unlink()
    with pytest.raises(StoreDamaged, match="is missing but store.state says this directory held a store"):
        preflight(tmp_path)


def test_preflight_names_the_file_and_the_truncation(tmp_path):
    make_store(tmp_path, 1000)
    with open(tmp_path / DATA_FILE, "r+b") as f:
        f.truncate(8 * KiB)
    with pytest.raises(StoreDamaged, match=rf"{tmp_path / DATA_FILE}: data.mdb is 8192 bytes but"):
        preflight(tmp_path)


def test_the_marker_is_written_once_and_readable(tmp_path):
    write_marker(tmp_path, 4096)
    first = (tmp_path / MARKER).read_text()
    assert json.loads(first)["page_size"] == 4096 and "created" in json.loads(first)
    write_marker(tmp_path, 8192)
    assert (tmp_path / MARKER).read_text() == first
    assert read_marker(tmp_path)["store"] == "amqpbroker"
    (tmp_path / MARKER).write_text("not json")
    assert read_marker(tmp_path) == {"unreadable": "not json"}
