"""The store's journal: one fdatasync per group commit, in front of LMDB.

An LMDB commit with sync costs two syncs and the page writes between them (the
data pages, then the meta page that makes them the new state: 3.5 fsyncs of time
in one measurement).  The writer process (store/writer.py) instead applies each
group of batches to LMDB *without* syncing (MDB_NOSYNC: readers, page-in and a
store copy see it at once) and appends the same batch frames to this journal with
one fdatasync; only then is the group reported committed.  The record is written
(`write`, its write-back started with sync_file_range) just before the LMDB
transaction and synced (`sync`) after it, so the device writes it meanwhile; a
transaction that fails takes it back (`retract`: zeroed and synced before the
failure is reported, since its group must never be applied).  Every so often (and
when the journal is half full, and at a clean stop) a **checkpoint** syncs LMDB
and starts the journal afresh.

Why this is safe across a system crash, where MDB_NOSYNC alone is not (LMDB's
documentation: the kernel may write the meta page before the pages it points to,
"a system crash can corrupt the database"):

* A checkpoint is `env.sync()`, then both meta pages as they are on disk go into
  the journal's header with a new epoch (fdatasync).  From then on the writer
  holds a read transaction on that snapshot, so LMDB reuses none of its pages
  until the next checkpoint is in the header (LMDB reuses a page only once no
  reader's snapshot can reach it); the only pages written in place are the two
  meta pages.
* At start (`restore`, before anything maps data.mdb) the checkpoint's meta pages
  are written back: LMDB is then exactly at the checkpoint, whatever the crash left
  in the meta pages; the journal's records of that epoch are applied again on top
  (`replay`: blind puts and deletes, in their order, as the writer applied them),
  and a new checkpoint is taken.
* A record counts only whole: magic, epoch, length and CRC-32.  Replay stops at the
  first record that is torn (a crash in the middle of an append: its group was
  never reported committed), or of another epoch (left over from before the last
  checkpoint: the file is reused in place).
* A whole record whose group was not reported yet (a crash between its write and
  the result) is applied: nobody was told either way, the producers of its
  messages send them again or not (at least once).  One whose transaction failed
  was zeroed before the failure was reported.
* A header slot is written only after the sync it describes, into the older of two
  slots (as LMDB does with its meta pages): a crash while writing it leaves the
  previous checkpoint, whose pages are still pinned, and its records.

The file is zero-filled when created, so an append overwrites blocks already
allocated: fdatasync then writes the data and no file-system metadata (no size
change, no unwritten extent to convert), and a full disk cannot stop an append.
A group larger than the record area is made durable by a checkpoint instead.

The journal belongs to one data.mdb: the header records its device and inode and
the checkpoint's transaction id.  A data.mdb put in place since (a restored
backup, a replica's copy), or one older than the checkpoint, makes the journal
stale: it is started afresh, never applied.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .integrity import DATA_FILE, META_SIZE, Meta, StoreDamaged, parse_meta

log = logging.getLogger("amqpbroker.store")

FILE = "journal"
SIZE = 16 << 20                 # bytes of the file (zero-filled once)
SLOT = 64 << 10                 # a header slot: fields, both meta pages (any LMDB page size), CRC
RECORDS_AT = 2 * SLOT           # the record area starts here
CHECKPOINT_AT = (SIZE - RECORDS_AT) // 2   # record bytes after which the writer checkpoints

_SLOT_HEAD = struct.Struct(">8sIIQQQQI")  # magic, version, clean, epoch, txnid, dev, ino, meta bytes
_SLOT_MAGIC = b"AMQPBJNL"
_VERSION = 1
_REC_HEAD = struct.Struct(">IQII")        # magic, epoch, payload length, crc32(epoch, length, payload)
_REC_MAGIC = 0x4A524543
_CRC = struct.Struct(">I")


class JournalError(Exception):
    pass


@dataclass
class Checkpoint:
    epoch: int
    txnid: int          # LMDB's transaction at the checkpoint
    dev: int            # data.mdb's identity
    ino: int
    metas: bytes        # data.mdb's two meta pages, as they were on disk after the sync
    slot: int           # 0 or 1
    clean: bool = False # the writer's last checkpoint at a clean stop: nothing wrote without a sync since


def _encode_slot(cp: Checkpoint) -> bytes:
    body = _SLOT_HEAD.pack(_SLOT_MAGIC, _VERSION, int(cp.clean), cp.epoch, cp.txnid, cp.dev, cp.ino,
                           len(cp.metas)) + cp.metas
    if len(body) + _CRC.size > SLOT:
        raise JournalError(f"meta pages of {len(cp.metas)} bytes do not fit a journal header slot")
    return body + _CRC.pack(zlib.crc32(body))


def _decode_slot(raw: bytes, index: int) -> Checkpoint | None:
    if len(raw) < _SLOT_HEAD.size:
        return None
    magic, version, clean, epoch, txnid, dev, ino, n = _SLOT_HEAD.unpack_from(raw, 0)
    end = _SLOT_HEAD.size + n
    if magic != _SLOT_MAGIC or version != _VERSION or end + _CRC.size > len(raw):
        return None
    if _CRC.unpack_from(raw, end)[0] != zlib.crc32(raw[:end]):
        return None   # torn or never written
    return Checkpoint(epoch, txnid, dev, ino, bytes(raw[_SLOT_HEAD.size:end]), index, bool(clean))


def encode_record(epoch: int, payload: bytes) -> bytes:
    head = struct.pack(">QI", epoch, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return _REC_HEAD.pack(_REC_MAGIC, epoch, len(payload), crc) + payload


def identity(store_dir: Path) -> tuple[int, int]:
    st = os.stat(Path(store_dir) / DATA_FILE)
    return st.st_dev, st.st_ino


def read_metas(store_dir: Path, page_size: int) -> bytes:
    with open(Path(store_dir) / DATA_FILE, "rb") as f:
        return f.read(2 * page_size)


def newest(metas: bytes) -> Meta:
    """The meta page LMDB uses (the newer of the two) of data.mdb's first two pages;
    StoreDamaged when they are not LMDB meta pages."""
    first = parse_meta(metas, 0)
    psize = first.page_size
    second = parse_meta(metas[psize:psize + META_SIZE], 1, psize)
    return first if first.txnid >= second.txnid else second


class Journal:
    """The journal file of one store directory (open: `Journal.open`)."""

    def __init__(self, store_dir: Path, fd: int, checkpoint: Checkpoint | None, size: int):
        self.store_dir = Path(store_dir)
        self.fd = fd
        self.size = size
        self.checkpoint_at = min(CHECKPOINT_AT, (size - RECORDS_AT) // 2)
        self.current = checkpoint           # the newest valid checkpoint (None: start afresh)
        self.floor = checkpoint.epoch if checkpoint is not None else 0   # the highest epoch seen
        self.position = RECORDS_AT          # where the next record goes
        self.checkpointed = time.monotonic()
        self.trace = None                   # the writer's loop trace (looptrace.py), or None
        self.written = 0                    # bytes of a record written, not synced yet (write)

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, store_dir: Path, size: int | None = None) -> "Journal":
        """Open (or create, zero-filled) the journal of `store_dir`."""
        size = size or SIZE
        path = Path(store_dir) / FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            if have < size:
                _zero_fill(fd, have, size)
                from .integrity import sync_dir
                sync_dir(Path(store_dir))
            size = max(size, have)
            slots = [_decode_slot(os.pread(fd, SLOT, i * SLOT), i) for i in (0, 1)]
        except BaseException:
            os.close(fd)
            raise
        valid = [s for s in slots if s is not None]
        return cls(store_dir, fd, max(valid, key=lambda s: s.epoch) if valid else None, size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ records

    @property
    def used(self) -> int:
        return self.position - RECORDS_AT

    def fits(self, nbytes: int) -> bool:
        """Whether a record of `nbytes` payload fits after the last one."""
        return self.position + _REC_HEAD.size + nbytes <= self.size

    def fits_empty(self, nbytes: int) -> bool:
        return RECORDS_AT + _REC_HEAD.size + nbytes <= self.size

    def append(self, payload: bytes) -> None:
        """One record, on disk when this returns (one fdatasync).  The caller checks
        `fits` first (and checkpoints when it does not)."""
        self.write(payload)
        self.sync()

    def write(self, payload: bytes) -> int:
        """One record written after the last one and its way to the disk started
        (sync_file_range: the device writes it while the caller applies the same
        group to LMDB); it counts once `sync` returned.  Until then the caller may
        take it back (`retract`): a group whose transaction failed is reported
        failed and must never be applied.  The record's position."""
        if self.current is None:
            raise JournalError("the journal has no checkpoint yet")
        record = encode_record(self.current.epoch, payload)
        if self.position + len(record) > self.size:
            raise JournalError("journal record beyond the end of the file")
        written = os.pwrite(self.fd, record, self.position)
        if written != len(record):
            raise OSError(f"journal: short write ({written} of {len(record)} bytes)")
        if _sync_file_range is not None:
            _sync_file_range(self.fd, self.position, len(record), _SYNC_FILE_RANGE_WRITE)   # a hint: no error
        if self.trace is not None:
            self.trace.mark("w-write", len(record))
        self.written = len(record)
        return self.position

    def sync(self) -> None:
        """The record `write` wrote is on disk (one fdatasync) and counts."""
        os.fdatasync(self.fd)
        if self.trace is not None:
            self.trace.mark("w-sync", self.written)
        self.position += self.written
        self.written = 0

    def retract(self) -> None:
        """The record `write` wrote never counts: zeroed on disk (one fdatasync: its
        write-back has started, a crash must not find it whole), the next record
        goes in its place."""
        if self.written:
            zeros = bytes(self.written)
            self.written = 0
            written = os.pwrite(self.fd, zeros, self.position)
            if written != len(zeros):
                raise OSError(f"journal: short write ({written} of {len(zeros)} bytes)")
            os.fdatasync(self.fd)

    def records(self) -> Iterator[bytes]:
        """The payloads of the current epoch's whole records, in order; sets the
        append position after the last."""
        cp = self.current
        pos = RECORDS_AT
        if cp is not None:
            while pos + _REC_HEAD.size <= self.size:
                head = os.pread(self.fd, _REC_HEAD.size, pos)
                magic, epoch, length, crc = _REC_HEAD.unpack(head)
                if magic != _REC_MAGIC or epoch != cp.epoch or pos + _REC_HEAD.size + length > self.size:
                    break
                payload = os.pread(self.fd, length, pos + _REC_HEAD.size)
                if len(payload) != length or zlib.crc32(payload, zlib.crc32(struct.pack(">QI", epoch, length))) != crc:
                    break   # a torn tail: that group was never reported committed
                yield payload
                pos += _REC_HEAD.size + length
        self.position = pos

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, env, clean: bool = False) -> Checkpoint:
        """LMDB synced, its meta pages recorded under a new epoch: every record so far
        is in LMDB for good, the record area starts afresh.  The caller keeps a read
        transaction on the snapshot from now until the next checkpoint (`pin`).
        `clean`: the last one of a writer that stops (nothing writes without a sync
        after it)."""
        env.sync(True)
        page_size = env.stat()["psize"]
        metas = read_metas(self.store_dir, page_size)
        meta = newest(metas)
        data = self.store_dir / DATA_FILE
        if os.stat(data).st_size < meta.needed_bytes:
            # LMDB does not write a page it allocated and freed again in the same
            # transaction (a loose page), so data.mdb may end before the last page its
            # meta page counts.  Extended with zeros (free pages: LMDB writes them when
            # it uses them), the file is whole for the start-up checks (integrity.py).
            with open(data, "r+b") as f:
                f.truncate(meta.needed_bytes)
                os.fsync(f.fileno())
        dev, ino = identity(self.store_dir)
        previous = self.current
        # Epochs only grow, also across a journal started afresh (stale records of an
        # earlier epoch must never read as current).
        epoch = previous.epoch + 1 if previous is not None else max(time.time_ns(), self.floor + 1)
        slot = 1 - previous.slot if previous is not None else 0
        cp = Checkpoint(epoch, meta.txnid, dev, ino, metas, slot, clean)
        data = _encode_slot(cp)
        written = os.pwrite(self.fd, data, slot * SLOT)
        if written != len(data):
            raise OSError(f"journal: short header write ({written} of {len(data)} bytes)")
        os.fdatasync(self.fd)
        self.current = cp
        self.position = RECORDS_AT
        self.checkpointed = time.monotonic()
        return cp


def _load_sync_file_range():
    """libc's sync_file_range (Linux), or None: then a record's write-back starts at
    its fdatasync, as any file's."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2   # start write-back of the range's dirty pages, do not wait


def _zero_fill(fd: int, start: int, end: int) -> None:
    chunk = b"\0" * (1 << 20)
    pos = start
    while pos < end:
        n = os.pwrite(fd, chunk[:min(len(chunk), end - pos)], pos)
        pos += n
    os.fsync(fd)   # the size and the blocks: later appends change neither


# ---------------------------------------------------------------------- start-up


def restore(store_dir: Path) -> tuple[Journal | None, list[bytes]]:
    """Before data.mdb is mapped: put LMDB back at the journal's checkpoint and
    return the records to apply again on top (empty when there are none).  A
    missing journal, or a stale one (another data.mdb, or one older than the
    checkpoint), restores nothing; the caller starts the journal afresh with a
    checkpoint once LMDB is open."""
    store_dir = Path(store_dir)
    data = store_dir / DATA_FILE
    if not (store_dir / FILE).exists() or not data.exists() or data.stat().st_size == 0:
        return None, []
    journal = Journal.open(store_dir)
    cp = journal.current
    if cp is None:
        return journal, []
    where = f"store at {store_dir}"
    if cp.clean:
        # The writer stopped cleanly: LMDB was synced then, and whatever changed it
        # since (a tool, a test) committed with LMDB's own syncs.  Nothing to undo.
        journal.current = None
        return journal, []
    if (cp.dev, cp.ino) != identity(store_dir):
        # (a restored backup, a replica's copy: expected, and that file is what counts)
        log.info("%s: the journal belongs to another %s (it was replaced); not applied", where, DATA_FILE)
        journal.current = None
        return journal, []
    with open(data, "r+b") as f:
        head = f.read(len(cp.metas))
        try:
            on_disk = newest(head)
        except StoreDamaged:
            on_disk = None   # (torn: setting LMDB back is what mends it)
        if on_disk is not None and on_disk.txnid < cp.txnid:
            log.warning("%s: %s is older than the journal's checkpoint (transaction %d < %d): it was "
                        "replaced; the journal is not applied", where, DATA_FILE, on_disk.txnid, cp.txnid)
            journal.current = None
            return journal, []
        records = list(journal.records())
        if head != cp.metas:
            # LMDB back at the checkpoint (its pages were pinned since): whatever the
            # meta pages say now may point at pages a system crash did not write.
            f.seek(0)
            f.write(cp.metas)
            f.flush()
            os.fsync(f.fileno())
            log.info("%s: LMDB set back to the journal's checkpoint (transaction %d) to apply %d "
                     "journal record(s) again", where, cp.txnid, len(records))
    return journal, records
