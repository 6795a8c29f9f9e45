"""Duplicate detection: a bounded window of message-ids per address.  Pure: no I/O.

A producer that resends after a failure (a Spark task retried, a micro-batch
replayed, a client that reconnected without knowing whether its transfer was
accepted) sends the same message-id again.  For an address that matches a
`[[duplicate_detection]]` rule the broker remembers the last `window` ids that
arrived there; a message whose id is in the window is accepted and dropped.

The window is LRU *by arrival*: a duplicate does not refresh an id, so an id is
forgotten `window` new messages after it first arrived.  Messages without a
message-id are never duplicates.

The store keeps each remembered id (see `id_key`/`DedupWindows.restore`), so the
window survives a restart: an id is written in the same store batch as the
message it arrived with.
"""

from __future__ import annotations

import fnmatch
import hashlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class DedupRule:
    pattern: str          # fnmatch glob on the address (`*`, `?`, `[...]`)
    window: int = 100_000

    def matches(self, address: str) -> bool:
        return fnmatch.fnmatchcase(address, self.pattern)


MAX_ID_KEY = 200   # longer ids are kept as a digest (LMDB keys are at most 511 bytes)


def id_key(message_id: Any) -> bytes | None:
    """A message-id as bytes, tagged by AMQP type (ulong 1 and string "1" differ)."""
    if message_id is None or isinstance(message_id, bool):
        return None
    if isinstance(message_id, str):
        key = b"s:" + message_id.encode("utf-8")
    elif isinstance(message_id, int):
        key = b"u:" + str(int(message_id)).encode()
    elif isinstance(message_id, uuid.UUID):
        key = b"x:" + message_id.bytes
    elif isinstance(message_id, (bytes, bytearray, memoryview)):
        key = b"b:" + bytes(message_id)
    else:
        key = b"r:" + repr(message_id).encode("utf-8", "replace")
    if len(key) > MAX_ID_KEY:
        key = b"h:" + hashlib.sha256(key).digest()
    return key


class DedupWindow:
    """The last `capacity` ids seen on one address, oldest first."""

    __slots__ = ("capacity", "_ids", "_counter")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("a duplicate-detection window holds at least one id")
        self.capacity = capacity
        self._ids: OrderedDict[bytes, int] = OrderedDict()
        self._counter = 0

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ids

    def add(self, key: bytes) -> tuple[int, list[bytes]]:
        """Remember a new id; return its arrival number and the ids evicted."""
        self._counter += 1
        self._ids[key] = self._counter
        evicted = []
        while len(self._ids) > self.capacity:
            old, _ = self._ids.popitem(last=False)
            evicted.append(old)
        return self._counter, evicted

    def forget(self, key: bytes) -> bool:
        return self._ids.pop(key, None) is not None

    def restore(self, items: Iterable[tuple[bytes, int]]) -> list[bytes]:
        """Rebuild from stored (id, arrival) pairs; return the ids beyond capacity
        (the window was made smaller since they were stored)."""
        ordered = sorted(items, key=lambda kv: kv[1])
        for key, n in ordered:
            self._ids[key] = n
            self._counter = max(self._counter, n)
        evicted = []
        while len(self._ids) > self.capacity:
            old, _ = self._ids.popitem(last=False)
            evicted.append(old)
        return evicted


class DedupWindows:
    """Windows for every address that matches a rule (first matching rule wins)."""

    def __init__(self, rules: Iterable[DedupRule]):
        self.rules = list(rules)
        self.windows: dict[str, DedupWindow] = {}
        self._rule_for: dict[str, DedupRule | None] = {}
        self.dropped_total = 0

    def rule_for(self, address: str) -> DedupRule | None:
        try:
            return self._rule_for[address]
        except KeyError:
            rule = next((r for r in self.rules if r.matches(address)), None)
            if len(self._rule_for) > 65_536:   # many one-off addresses: don't grow forever
                self._rule_for.clear()
            self._rule_for[address] = rule
            return rule

    def window(self, address: str) -> DedupWindow | None:
        w = self.windows.get(address)
        if w is not None:
            return w
        rule = self.rule_for(address)
        if rule is None:
            return None
        w = self.windows[address] = DedupWindow(rule.window)
        return w

    def is_duplicate(self, address: str, key: bytes | None) -> bool:
        if key is None:
            return False
        w = self.window(address)
        return w is not None and key in w

    def record(self, address: str, key: bytes | None) -> tuple[int, list[bytes]] | None:
        """Remember an id that was accepted; None when the address has no rule."""
        if key is None:
            return None
        w = self.window(address)
        if w is None:
            return None
        return w.add(key)


def store_key(address: str, key: bytes) -> bytes:
    """The store's key for one remembered id: address, NUL, id key."""
    return address.encode("utf-8") + b"\x00" + key


def split_store_key(raw: bytes) -> tuple[str, bytes]:
    address, _, key = bytes(raw).partition(b"\x00")
    return address.decode("utf-8"), key
