"""Whole numbers written in text the broker did not write itself this run (a file or
directory name in the data dir, a lock file, a cgroup file, an address, a header).

One parser, because the obvious test is wrong: `str.isdigit` is true for `²` and
other Unicode digits that `int` refuses with ValueError, so `if s.isdigit(): int(s)`
can raise where the caller meant "not a number"."""

from __future__ import annotations


def ascii_int(text: str) -> int | None:
    """The value of `text` if it is one or more ASCII digits (no sign, no spaces),
    else None."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)
