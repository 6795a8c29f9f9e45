"""Keeping LMDB's memory map, and a burst's freed buffers, out of RSS (bounded memory).

Every store page a process touches (scans, fills, drains) stays mapped and counts
in its RSS.  `release_map` drops those page-table entries again; the data stays in
the kernel's page cache and a later read faults a page back in.  Used by the broker
(after recovery scans, periodically while it pages) and by the writer process.
"""

from __future__ import annotations

import ctypes
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
    """After a burst, when idle: trim the C heap; (0, seconds taken).

    No garbage collection here: closed connections hold no reference cycle
    (server/handlers.py ConnectionHandler.release), so what a burst freed is freed
    already, and a full collection would stall every connection of a broker holding
    millions of objects.  glibc keeps freed memory mapped until trimmed."""
    started = time.perf_counter()
    trim_heap()
    return 0, time.perf_counter() - started
