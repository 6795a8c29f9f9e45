"""Is the store on disk whole?  Checks made before LMDB maps a byte of it.

LMDB maps `data.mdb` and trusts it: a file shorter than its own meta pages say
is a SIGBUS at the first read past its end (no exception, no log line), and a
missing or empty file is silently a new, empty store.  So before `lmdb.open`:

* `check_header` (pure: bytes and a page reader in, verdict out): the two meta
  pages at the head of the file and the file's size.  The newer meta page records
  the last page in use ("last page"), but LMDB (without writemap) writes only the
  pages still in use at commit: pages a transaction took from the end and gave back
  before committing (a value written then deleted, a split page merged again) are
  counted in the last page, put on the free list and never written, so a healthy
  file may end before (last page + 1) x page size.  Nothing reads a free page before
  it is used again (and written).  So a whole file holds every page up to the
  highest page in use that is *not* on the free list (`needed_size`); the free
  list (LMDB's free database: transaction id -> list of page numbers) is read from
  the file, only when the file is shorter than the last page says.
* `preflight` (file level): that, plus the marker file `store.state` written
  beside data.mdb once a store exists.  A marker without data.mdb, or with an
  empty one, is a store that vanished, not a new one.

The deeper walk (every page every record uses) is in store/verify.py; it runs in
a child process because damaged pages can kill the process that reads them.

LMDB's meta page (mdb.c, `MDB_page` + `MDB_meta`, data format version 1; native
byte order, 64-bit `size_t` / `pgno_t` / `txnid_t`), pinned against py-lmdb by
tests/store/test_integrity.py:

    offset  field
    0       page header: mp_pgno (u64, 0 or 1), mp_pad (u16), mp_flags (u16: P_META
            0x08), lower/upper (u16 x 2)
    16      mm_magic (u32, 0xBEEFC0DE)
    20      mm_version (u32, 1)
    24      mm_address (u64)
    32      mm_mapsize (u64)
    40      mm_dbs[0] (free list, 48 bytes): md_pad (u32) = page size, md_flags (u16),
            md_depth (u16), branch/leaf/overflow pages, entries, root (u64 each)
    88      mm_dbs[1] (main database, 48 bytes): same layout
    136     mm_last_pg (u64): the last page in use
    144     mm_txnid (u64): the transaction that wrote this meta page

A page of the free database (mdb.c `MDB_page`, `MDB_node`):

    0       mp_pgno (u64): the page's own number
    10      mp_flags (u16): P_BRANCH 0x01, P_LEAF 0x02, P_OVERFLOW 0x04
    12      mp_lower, mp_upper (u16 x 2); an overflow page: mp_pages (u32), its length
    16      mp_ptrs (u16 each, (mp_lower - 16) / 2 of them): offsets of the nodes
    node    mn_lo, mn_hi (u16 x 2), mn_flags (u16), mn_ksize (u16), key, data
            branch: child page = mn_lo | mn_hi << 16 | mn_flags << 32
            leaf: data size = mn_lo | mn_hi << 16; F_BIGDATA (0x01): the data is the
            number (u64) of the overflow page holding it
    data    an IDL: a count (u64), then that many page numbers (u64)
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import StoreError

DATA_FILE = "data.mdb"
MARKER = "store.state"
RECOVERY_HINT = ("check it with `amqpbroker store check --data-dir DIR` and restore a copy "
                 "(docs/operations.md, \"Store safety and recovery\")")

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_META = 0x08
P_INVALID = (1 << 64) - 1
MIN_PAGE, MAX_PAGE = 512, 65536        # LMDB's page size bounds (MDB_MINPAGESIZE .. MAX_PAGESIZE)
META_SIZE = 152                        # header + MDB_meta, see the table above
_HEAD = struct.Struct("=QHHI")         # mp_pgno, mp_pad, mp_flags, lower/upper
_META = struct.Struct("=IIQQ")         # magic, version, address, mapsize
_DB = struct.Struct("=IHHQQQQQ")       # pad, flags, depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("=QQ")           # last_pg, txnid
HEADER_BYTES = 2 * MAX_PAGE            # enough of the file for both meta pages, any page size
_NATIVE_64 = struct.calcsize("P") == 8
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01
_NODE = struct.Struct("=HHHH")         # mn_lo, mn_hi, mn_flags, mn_ksize
_U64 = struct.Struct("=Q")

# read(first page, count, page size) -> the bytes of those pages (shorter past the end)
PageReader = Callable[[int, int, int], bytes]


class StoreDamaged(StoreError):
    """The store on disk is not whole (truncated, vanished, unreadable pages)."""


@dataclass(frozen=True)
class Meta:
    page: int           # 0 or 1
    page_size: int
    map_size: int
    last_page: int
    txnid: int
    main_root: int      # P_INVALID: empty main database
    main_pages: int     # branch + leaf + overflow pages of the main database
    free_root: int
    free_pages: int

    @property
    def needed_bytes(self) -> int:
        """What a file holding every page up to the last one holds; a healthy file may
        hold less (its tail free, never written): see `needed_size`."""
        return (self.last_page + 1) * self.page_size


def parse_meta(page: bytes, index: int, page_size: int | None = None) -> Meta:
    """The meta page `index` (0 or 1), from its first META_SIZE bytes; StoreDamaged
    naming what is wrong.  `page_size`: the one page 0 gave (page 1 must agree)."""
    where = f"meta page {index} of {DATA_FILE}"
    if len(page) < META_SIZE:
        raise StoreDamaged(f"{where} is cut short ({len(page)} of {META_SIZE} bytes)")
    pgno, _, flags, _ = _HEAD.unpack_from(page, 0)
    magic, version, _, map_size = _META.unpack_from(page, _HEAD.size)
    free = _DB.unpack_from(page, 40)
    main = _DB.unpack_from(page, 88)
    last_page, txnid = _TAIL.unpack_from(page, 136)
    if magic != MAGIC:
        raise StoreDamaged(f"{where} is not an LMDB meta page (magic {magic:#010x}, expected {MAGIC:#010x})")
    if not flags & P_META or pgno != index:
        raise StoreDamaged(f"{where} is damaged (page number {pgno}, flags {flags:#x})")
    if version != DATA_VERSION:
        raise StoreDamaged(f"{where} has LMDB data version {version}; this LMDB reads version {DATA_VERSION}")
    size = free[0]
    if size < MIN_PAGE or size > MAX_PAGE or size & (size - 1) or (page_size is not None and size != page_size):
        raise StoreDamaged(f"{where} is damaged (page size {size})")
    meta = Meta(index, size, map_size, last_page, txnid, main[7], main[3] + main[4] + main[5],
                free[7], free[3] + free[4] + free[5])
    if last_page < 1 or meta.needed_bytes > map_size:
        raise StoreDamaged(f"{where} is damaged (last page {last_page}, map size {map_size})")
    for name, root, pages in (("main", meta.main_root, meta.main_pages), ("free", meta.free_root, meta.free_pages)):
        if (root != P_INVALID and not 2 <= root <= last_page) or pages > last_page:
            raise StoreDamaged(f"{where} is damaged ({name} database root {root}, {pages} pages, "
                               f"last page {last_page})")
    return meta


def check_header(head: bytes, file_size: int, read: PageReader | None = None) -> Meta:
    """The meta page LMDB will use (the newer of the two) of a data.mdb whose first
    bytes are `head` and whose size is `file_size`; StoreDamaged when the file
    cannot be whole.  `read` gives pages of the file beyond `head` (the free list is
    read only when the file ends before the last page).  Pure: bytes in, verdict out."""
    if not _NATIVE_64:   # the layout above is the 64-bit one
        raise StoreDamaged("store checks need a 64-bit platform")
    if file_size < 2 * MIN_PAGE or len(head) < META_SIZE:
        raise StoreDamaged(f"{DATA_FILE} is {file_size} bytes: too short to hold LMDB's two meta pages "
                           "(the file was truncated)")
    first = parse_meta(head, 0)
    psize = first.page_size
    if file_size < 2 * psize or len(head) < psize + META_SIZE:
        raise StoreDamaged(f"{DATA_FILE} is {file_size} bytes: too short to hold LMDB's two meta pages "
                           f"of {psize} bytes (the file was truncated)")
    second = parse_meta(head[psize:psize + META_SIZE], 1, psize)
    meta = first if first.txnid >= second.txnid else second
    if file_size < meta.needed_bytes:
        needed_size(meta, file_size, read or _reader_of(head))
    return meta


def file_pages(file_size: int, page_size: int) -> int:
    """Whole pages in a file of `file_size` bytes (a part of a page is no page)."""
    return file_size // page_size


def needed_size(meta: Meta, file_size: int, read: PageReader) -> int:
    """The least a whole data.mdb of this meta page holds: every page up to the
    highest one in use, i.e. up to the last page less the free pages at the top.
    StoreDamaged when the file ends before a page in use (truncated), or when the
    free list it must read is past the end or damaged."""
    psize = meta.page_size
    have = file_pages(file_size, psize)
    records = (f"{DATA_FILE} is {file_size} bytes but its meta page {meta.page} (transaction {meta.txnid}) "
               f"records {meta.last_page + 1} pages of {psize} bytes ({meta.needed_bytes} bytes)")
    try:
        free = _free_pages(meta, read, have)
    except _PastEnd as exc:
        raise StoreDamaged(f"{records} and page {exc.pgno} of its free list is past its end: "
                           "the file was truncated") from None
    top = meta.last_page
    while top >= have and top in free:
        top -= 1
    if top >= have:
        raise StoreDamaged(f"{records} and page {top}, past its end, is in use (not on LMDB's free "
                           "list): the file was truncated")
    while top > 1 and top in free:   # within the file: the exact boundary (tests, tools)
        top -= 1
    return (top + 1) * psize


def _free_pages(meta: Meta, read: PageReader, have: int) -> set[int]:
    """The pages on the free list of `meta` (LMDB's free database, read page by
    page: bounded by the pages the meta page counts in it)."""
    out: set[int] = set()
    root = meta.free_root
    if root == P_INVALID:
        return out
    psize = meta.page_size
    where = f"the free list of {DATA_FILE} (meta page {meta.page}, transaction {meta.txnid})"
    stack, seen = [root], set()
    while stack:
        pgno = stack.pop()
        if pgno in seen or len(seen) > meta.free_pages or pgno > meta.last_page:
            raise StoreDamaged(f"{where} is damaged (page {pgno})")
        seen.add(pgno)
        page = _page(read, pgno, 1, psize, have)
        number, _, flags, lower, upper = struct.unpack_from("=QHHHH", page, 0)
        if number != pgno or not flags & (P_BRANCH | P_LEAF) or not 16 <= lower <= upper <= psize:
            raise StoreDamaged(f"{where} is damaged (page {pgno}: number {number}, flags {flags:#x})")
        for ptr in struct.unpack_from(f"={(lower - 16) // 2}H", page, 16):
            if not upper <= ptr <= psize - _NODE.size:
                raise StoreDamaged(f"{where} is damaged (page {pgno}: a node at offset {ptr})")
            lo, hi, nflags, ksize = _NODE.unpack_from(page, ptr)
            if flags & P_BRANCH:
                stack.append(lo | hi << 16 | nflags << 32)
                continue
            data_at, size = ptr + _NODE.size + ksize, lo | hi << 16
            if nflags & F_BIGDATA:
                (overflow,) = _U64.unpack_from(page, data_at)
                head = _page(read, overflow, 1, psize, have)
                count = struct.unpack_from("=I", head, 12)[0]
                if overflow + count - 1 > meta.last_page or count * psize < 16 + size:
                    raise StoreDamaged(f"{where} is damaged (overflow page {overflow} of {count} pages)")
                seen.update(range(overflow, overflow + count))
                data = _page(read, overflow, count, psize, have)[16:16 + size]
            else:
                data = page[data_at:data_at + size]
            out.update(_idl(data, where))
    return out


def _idl(data: bytes, where: str) -> tuple[int, ...]:
    """The page numbers of one free-list record (a count, then the numbers)."""
    if len(data) < 8:
        raise StoreDamaged(f"{where} is damaged (a record of {len(data)} bytes)")
    (count,) = _U64.unpack_from(data, 0)
    if 8 + 8 * count > len(data):
        raise StoreDamaged(f"{where} is damaged (a record of {count} pages in {len(data)} bytes)")
    return struct.unpack_from(f"={count}Q", data, 8)


class _PastEnd(Exception):
    def __init__(self, pgno: int):
        self.pgno = pgno


def _page(read: PageReader, pgno: int, count: int, psize: int, have: int) -> bytes:
    """`count` pages from `pgno`; _PastEnd when the file ends before them."""
    data = read(pgno, count, psize) if pgno + count <= have else b""
    if len(data) < count * psize:
        raise _PastEnd(pgno + count - 1)
    return data


def _reader_of(head: bytes) -> PageReader:
    """Pages out of the bytes at hand (the head of the file)."""
    return lambda pgno, count, psize: head[pgno * psize:(pgno + count) * psize]


# ---------------------------------------------------------------------- files


@dataclass
class Preflight:
    exists: bool                 # data.mdb with content: an existing store
    meta: Meta | None
    marker: dict | None          # store.state, when present


def read_marker(store_dir: Path) -> dict | None:
    try:
        text = (Path(store_dir) / MARKER).read_text()
    except FileNotFoundError:
        return None
    try:
        out = json.loads(text)
        return out if isinstance(out, dict) else {"unreadable": text[:80]}
    except ValueError:
        return {"unreadable": text[:80]}


def write_marker(store_dir: Path, page_size: int) -> None:
    """Note that this directory holds a store (once: kept as first written).  Written
    beside data.mdb, atomically (temporary file, fsync, rename, fsync of the dir)."""
    store_dir = Path(store_dir)
    target = store_dir / MARKER
    if target.exists():
        return
    tmp = store_dir / (MARKER + ".tmp")
    body = json.dumps({"store": "amqpbroker", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "page_size": page_size}) + "\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    sync_dir(store_dir)


def sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def preflight(store_dir: Path) -> Preflight:
    """What is on disk at `store_dir`, checked before LMDB opens it; StoreDamaged
    (a one-line reason) when it is not whole."""
    store_dir = Path(store_dir)
    data = store_dir / DATA_FILE
    marker = read_marker(store_dir)
    created = f" (created {marker['created']})" if marker and marker.get("created") else ""
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        if marker is not None:
            raise StoreDamaged(
                f"{data} is missing but {MARKER} says this directory held a store{created}: refusing to "
                f"start with an empty store; restore a copy, or delete {MARKER} to start empty on purpose")
        return Preflight(False, None, None)
    if size == 0:
        if marker is not None:
            raise StoreDamaged(
                f"{data} is empty (0 bytes) but {MARKER} says this directory held a store{created}: "
                f"the file was truncated; restore a copy, or delete {DATA_FILE} and {MARKER} to start "
                "empty on purpose")
        return Preflight(False, None, None)   # created, never committed: LMDB starts it afresh
    try:
        with open(data, "rb") as f:
            head = f.read(HEADER_BYTES)

            def read(pgno: int, count: int, psize: int) -> bytes:
                return os.pread(f.fileno(), count * psize, pgno * psize)

            try:
                meta = check_header(head, size, read)
            except StoreDamaged as exc:
                raise StoreDamaged(f"{data}: {exc}") from None
    except OSError as exc:
        raise StoreDamaged(f"cannot read {data}: {exc}") from exc
    return Preflight(True, meta, marker)
