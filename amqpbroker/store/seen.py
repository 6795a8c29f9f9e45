"""Recovery's record of the stored message ids met so far (which messages more than
one entry or log record refers to)."""

from __future__ import annotations


class SeenIds:
    """Recovery: the message ids met so far, to find messages with more than one
    entry.  A bitmap over the store's id range (125 kB per million ids) rather than
    a set of ints (~60 MB per million); a set only for ids outside a sane range."""

    MAX_BITS = 1 << 28   # a 32 MiB bitmap at most

    def __init__(self, lo: int, hi: int):
        self.lo = lo
        span = hi - lo + 1
        self.bits = bytearray((span + 7) >> 3) if 0 < span <= self.MAX_BITS else bytearray()
        self.nbits = len(self.bits) << 3
        self.others: set[int] = set()

    def add(self, mid: int) -> bool:
        """Note `mid`; True when it was met before."""
        i = mid - self.lo
        if 0 <= i < self.nbits:
            bits = self.bits
            byte, mask = bits[i >> 3], 1 << (i & 7)
            if byte & mask:
                return True
            bits[i >> 3] = byte | mask
            return False
        if mid in self.others:
            return True
        self.others.add(mid)
        return False

    def __contains__(self, mid: int) -> bool:
        i = mid - self.lo
        if 0 <= i < self.nbits:
            return bool(self.bits[i >> 3] & (1 << (i & 7)))
        return mid in self.others
