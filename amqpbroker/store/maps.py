"""Keeping LMDB's memory map, and a burst's freed buffers, out of RSS (bounded memory).

Every store page a process touches (scans, fills, drains) stays mapped and counts
in its RSS.  `release_map` drops those page-table entries again; the data stays in
the kernel's page cache and a later read faults a page back in.  Used by the broker
(after recovery scans, periodically while it pages) and by the writer process.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from pathlib import Path
from typing import Callable


def _load_madvise() -> Callable[[int, int, int], int] | None:
    """libc madvise(2), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
_MADV_DONTNEED = 4


def release_map(store_dir: str | Path) -> int:
    """Unmap the pages of `store_dir`/data.mdb this process has touched.  Only the
    shared read-only map (no writemap) is advised: MADV_DONTNEED there drops
    page-table entries, never data.  Linux only; returns the bytes advised (0
    elsewhere or on failure)."""
    if _madvise is None:
        return 0
    target = str((Path(store_dir) / "data.mdb").resolve())
    done = 0
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split(None, 5) for line in f if line.rstrip("\n").endswith(target)]
    except OSError:
        return 0
    for fields in spans:
        if len(fields) < 6 or fields[5].rstrip("\n") != target or fields[1] != "r--s":
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if _madvise(start, end - start, _MADV_DONTNEED) == 0:
            done += end - start
    return done


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc malloc_trim(3), or None (another libc, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def trim_heap() -> bool:
    """Give the C heap's free memory back to the kernel (malloc_trim(0)).  A burst
    leaves its batches' buffers freed but still mapped: glibc returns only the top
    of its heaps by itself, and frees in the middle stay in RSS until reused.  Call
    it when idle (it walks the heap).  True when memory was released."""
    if _malloc_trim is None:
        return False
    try:
        return bool(_malloc_trim(0))
    except OSError:
        return False


def give_back_memory() -> tuple[int, float]:
    """After a burst, when idle: collect unreachable cycles, then trim the C heap;
    (objects collected, seconds taken).

    Why a full collection: the broker runs with a young-generation threshold of
    50,000 and everything from start-up frozen (cli.tune_gc), so once traffic stops
    no collection runs at all, and garbage in reference cycles stays.  After a
    durable burst from 8 producers that was 250 MB: the closed connections of the
    burst (AmqpProtocol, its handler and proton Transport refer to each other)
    holding proton's buffers.  The collection costs ~0.1 s per million tracked
    objects, once per burst, on an idle store."""
    started = time.perf_counter()
    collected = gc.collect()
    trim_heap()
    return collected, time.perf_counter() - started
