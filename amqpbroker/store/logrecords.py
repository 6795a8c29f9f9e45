"""How the topic log is stored (docs/architecture.md "Durable subscriptions"):
the encodings of log records, routes and cursors.

  entries db, queue id 0, position  ENTRY_VAL (msg id, delivery-count, 0, priority,
                                    size, expires-at, deliver-at) + LOG_TAIL (route id,
                                    group length, plus count, minus count) + group
                                    (utf-8) + plus + minus (queue ids, u32 each)
  routes db, route id (u32)         JSON ["exchange", name, key] | ["direct"] | ["every"]
  cursors db, queue id (u32)        CURSOR_HEAD (joined, left (0: none), floor, ranges,
                                    states, bumps) + ranges (lo, hi) + states (position,
                                    delivery-count, delivered) + bumps
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..core.cursors import Cursor
from .batch import ENTRY_VAL, U32

LOG_TAIL = struct.Struct(">IHII")
CURSOR_HEAD = struct.Struct(">QQQIII")
RANGE = struct.Struct(">QQ")
STATE = struct.Struct(">QIB")
BUMP = struct.Struct(">Q")
_NAN = float("nan")


@dataclass(slots=True)
class LogRecord:
    """A log record as read back (page-in, sequence reads)."""
    pos: int
    msg_id: int
    delivery_count: int
    priority: int
    size: int
    expires_at: float | None
    deliver_at: float | None
    group: str | None
    route: int
    plus: frozenset
    minus: frozenset


def encode_record(msg_id: int, delivery_count: int, priority: int, size: int, expires_at: float | None,
                  deliver_at: float | None, group: str | None, route: int,
                  plus: tuple[int, ...] = (), minus: tuple[int, ...] = ()) -> bytes:
    g = group.encode() if group is not None else b""
    head = ENTRY_VAL.pack(msg_id, delivery_count, 0, priority, size,
                          _NAN if expires_at is None else expires_at, _NAN if deliver_at is None else deliver_at)
    ids = struct.pack(f">{len(plus) + len(minus)}I", *plus, *minus) if plus or minus else b""
    return head + LOG_TAIL.pack(route, len(g), len(plus), len(minus)) + g + ids


def decode_record(pos: int, val: bytes) -> LogRecord:
    msg_id, count, _, priority, size, expires, deliver = ENTRY_VAL.unpack_from(val)
    route, glen, nplus, nminus = LOG_TAIL.unpack_from(val, ENTRY_VAL.size)
    off = ENTRY_VAL.size + LOG_TAIL.size
    group = bytes(val[off:off + glen]).decode() if glen else None
    plus, minus = _ids(val, off + glen, nplus, nminus)
    return LogRecord(pos, msg_id, count, priority, size, None if expires != expires else expires,
                     None if deliver != deliver else deliver, group, route, plus, minus)


def scan_row(pos: int, val: bytes) -> tuple[int, int, int, int, frozenset, frozenset]:
    """What recovery needs of a record: (position, route, size, plus, minus, msg id)."""
    msg_id, _, _, _, size = _HEAD.unpack_from(val)
    route, glen, nplus, nminus = LOG_TAIL.unpack_from(val, ENTRY_VAL.size)
    if nplus or nminus:
        plus, minus = _ids(val, ENTRY_VAL.size + LOG_TAIL.size + glen, nplus, nminus)
    else:
        plus = minus = _EMPTY
    return pos, route, size, plus, minus, msg_id


_HEAD = struct.Struct(">QIBBI")
_EMPTY: frozenset = frozenset()


def _ids(val: bytes, off: int, nplus: int, nminus: int) -> tuple[frozenset, frozenset]:
    if not nplus and not nminus:
        return _EMPTY, _EMPTY
    ids = struct.unpack_from(f">{nplus + nminus}I", val, off)
    return frozenset(ids[:nplus]), frozenset(ids[nplus:])


def encode_route(route: tuple) -> bytes:
    return json.dumps(list(route)).encode()


def decode_route(val: bytes) -> tuple:
    r = json.loads(val)
    if not isinstance(r, list) or not r or r[0] not in ("exchange", "direct", "every"):
        raise ValueError(f"not a log route: {r!r}")
    if r[0] == "exchange" and not (len(r) == 3 and isinstance(r[1], str) and isinstance(r[2], str)):
        raise ValueError(f"not an exchange route: {r!r}")
    return tuple(r)


class StoredCursor:
    """A member's cursor as the batch encodes it (Batch.put_live): read when the
    batch is sealed, so a cursor changed many times in a turn is written once."""

    __slots__ = ("cursor",)

    def __init__(self, cursor: Cursor):
        self.cursor = cursor

    def encode(self) -> bytes:
        return encode_cursor(self.cursor)


def encode_cursor(c: Cursor) -> bytes:
    c.prune()
    parts = [CURSOR_HEAD.pack(c.joined, c.left or 0, c.floor, len(c.ranges), len(c.states), len(c.bumps))]
    parts += [RANGE.pack(lo, hi) for lo, hi in c.ranges]
    parts += [STATE.pack(p, n, d) for p, (n, d) in sorted(c.states.items())]
    parts += [BUMP.pack(b) for b in c.bumps]
    return b"".join(parts)


def decode_cursor(val: bytes) -> Cursor:
    joined, left, floor, nr, ns, nb = CURSOR_HEAD.unpack_from(val)
    off = CURSOR_HEAD.size
    if len(val) != off + nr * RANGE.size + ns * STATE.size + nb * BUMP.size:
        raise ValueError(f"cursor record of {len(val)} bytes does not hold {nr}/{ns}/{nb} items")
    c = Cursor(joined, floor, left or None)
    for _ in range(nr):
        c.ranges.append(list(RANGE.unpack_from(val, off)))
        off += RANGE.size
    for _ in range(ns):
        p, n, d = STATE.unpack_from(val, off)
        c.states[p] = (n, bool(d))
        off += STATE.size
    for _ in range(nb):
        c.bumps.append(BUMP.unpack_from(val, off)[0])
        off += BUMP.size
    return c


def key(n: int) -> bytes:
    return U32.pack(n)


def unkey(k: Any) -> int:
    return U32.unpack(bytes(k))[0]
