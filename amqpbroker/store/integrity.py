"""Is the store on disk whole?  Checks made before LMDB maps a byte of it.

LMDB maps `data.mdb` and trusts it: a file shorter than its own meta pages say
is a SIGBUS at the first read past its end (no exception, no log line), and a
missing or empty file is silently a new, empty store.  So before `lmdb.open`:

* `check_header` (pure, on bytes): the two meta pages at the head of the file
  and the file's size.  A whole file is at least (last page + 1) x page size
  bytes, as the newer meta page records it.
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
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

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
        """The least a whole data.mdb holds: every page up to the last in use."""
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


def check_header(head: bytes, file_size: int) -> Meta:
    """The meta page LMDB will use (the newer of the two) of a data.mdb whose first
    bytes are `head` and whose size is `file_size`; StoreDamaged when the file
    cannot be whole.  Pure: bytes in, verdict out."""
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
        raise StoreDamaged(
            f"{DATA_FILE} is {file_size} bytes but its meta page {meta.page} (transaction {meta.txnid}) "
            f"records {meta.last_page + 1} pages of {psize} bytes ({meta.needed_bytes} bytes): "
            "the file was truncated")
    return meta


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
    except OSError as exc:
        raise StoreDamaged(f"cannot read {data}: {exc}") from exc
    try:
        meta = check_header(head, size)
    except StoreDamaged as exc:
        raise StoreDamaged(f"{data}: {exc}") from None
    return Preflight(True, meta, marker)
