"""Frames on their way down the writer process's pipe, bounded.

The outbox has a limit: LmdbStore frames (pickles) a sealed batch only while
fewer than `limit` bytes wait here.  Before it, every batch was pickled at
hand-over and appended to one bytearray, so a writer that fell behind (a burst
from many producers, a slow fsync) made the broker hold a second, pickled copy of
every message body in flight, and the heap it grew to stayed in RSS after the
burst.  Now a batch waits as it is (its message bytes are the ones the broker
holds anyway) until the pipe has room.  Each frame is its own bytes object, freed
as soon as the pipe has taken it, and a frame nothing of which was written can be
taken back (`take_unwritten`) when writing fails.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

OUTBOX_LIMIT = 8 << 20     # bytes of framed batches waiting for the pipe before framing pauses
_IOV_MAX = 64              # frames per writev


class Outbox:
    def __init__(self, limit: int = OUTBOX_LIMIT, faults: Any = None):
        self.limit = limit
        self.faults = faults                     # store/faults.py (tests only), or None
        self.frames: deque[tuple[int, memoryview]] = deque()   # (batch number, frame)
        self.offset = 0                          # bytes of the head frame written already
        self.nbytes = 0                          # bytes not written yet
        self.peak = 0                            # the most that ever waited (metrics, tests)

    def __len__(self) -> int:
        return len(self.frames)

    def has_room(self) -> bool:
        return self.nbytes < self.limit

    @property
    def mid_frame(self) -> bool:
        """Part of the head frame is in the pipe: the stream cannot be cut here."""
        return self.offset > 0

    def push(self, number: int, data: bytes) -> None:
        self.frames.append((number, memoryview(data)))
        self.nbytes += len(data)
        if self.nbytes > self.peak:
            self.peak = self.nbytes

    def write(self, fd: int) -> bool:
        """Write what the pipe takes now; True once everything is written.  A full
        pipe returns False; any other OSError is raised (nothing was written by the
        call that raised it)."""
        frames = self.frames
        while frames:
            if self.offset == 0 and self.faults is not None:
                self.faults.check("pipe-write")
            views = [view for _, view in _head(frames, _IOV_MAX)]
            if self.offset:
                views[0] = views[0][self.offset:]
            try:
                n = os.writev(fd, views)
            except BlockingIOError:
                return False
            self.nbytes -= n
            n += self.offset
            while frames and n >= len(frames[0][1]):
                n -= len(frames.popleft()[1])
            self.offset = n
            if n:
                return False   # the pipe took part of a frame: it is full
        return True

    def take_unwritten(self) -> list[int]:
        """Drop the frames nothing of which is written yet; their batch numbers."""
        keep = 1 if self.offset else 0
        out = []
        while len(self.frames) > keep:
            number, view = self.frames.pop()
            self.nbytes -= len(view)
            out.append(number)
        out.reverse()
        return out

    def clear(self) -> None:
        self.frames.clear()
        self.offset = 0
        self.nbytes = 0


def _head(frames: deque, n: int) -> list:
    out = []
    for item in frames:
        out.append(item)
        if len(out) >= n:
            break
    return out
