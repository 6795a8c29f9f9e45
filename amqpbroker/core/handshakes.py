"""Admission of sockets that have not opened an AMQP connection yet (pure).

`limits.max_connections` counts open connections only (it is checked at `open`), so
sockets still in the protocol header / SASL / open exchange need limits of their
own, or a flood of them (300 sockets trickling one byte every 20 s) takes file
descriptors and memory without ever being counted.  Every accepted socket is a
handshake until its connection opens or it goes; the gate refuses a new one beyond
`max_total` handshakes in all, or `max_per_address` from one source address (one
client's flood does not lock the others out).  The deadline for reaching `open`
from the moment of accept is the engine's (server/engine.py): trickled bytes do not
extend it.

A TLS listener counts a socket from accept too, before its TLS handshake (which a
client can stall as well as any other): the TLS layer takes a `HandshakeSlot` at
accept and the AMQP layer under it adopts that slot once TLS is done, instead of
being admitted a second time; whoever ends first gives it back, once.

`LogLimiter` keeps a flood from flooding the log: one line per key (an address),
then at most one per interval with the count since.
"""

from __future__ import annotations


class HandshakeGate:
    def __init__(self, max_total: int, max_per_address: int):
        self.max_total = max_total
        self.max_per_address = max_per_address
        self.in_progress = 0
        self._by_address: dict[str, int] = {}
        # Statistics (metrics).
        self.refused_total = 0
        self.timed_out_total = 0

    def admit(self, address: str) -> str | None:
        """Count a new socket in; or why it is refused (then it is not counted)."""
        if self.in_progress >= self.max_total:
            self.refused_total += 1
            return f"{self.in_progress} connections are in their handshake (limits.max_handshakes)"
        mine = self._by_address.get(address, 0)
        if mine >= self.max_per_address:
            self.refused_total += 1
            return (f"{mine} connections from {address} are in their handshake "
                    f"(limits.max_handshakes_per_address)")
        self.in_progress += 1
        self._by_address[address] = mine + 1
        return None

    def done(self, address: str) -> None:
        """The socket opened its connection, or went: it no longer counts."""
        left = self._by_address.get(address, 0) - 1
        if left < 0:
            return
        self.in_progress -= 1
        if left:
            self._by_address[address] = left
        else:
            del self._by_address[address]

    def addresses(self) -> int:
        return len(self._by_address)

    def slot(self, address: str, accepted_at: float) -> "HandshakeSlot | str":
        """Admit a socket whose slot outlives its first protocol layer (TLS); a
        refusal is the reason (str)."""
        refusal = self.admit(address)
        return refusal if refusal is not None else HandshakeSlot(self, address, accepted_at)


class HandshakeSlot:
    """One admitted socket's place in the gate; `release` gives it back once."""

    __slots__ = ("gate", "address", "accepted_at", "released")

    def __init__(self, gate: HandshakeGate, address: str, accepted_at: float):
        self.gate = gate
        self.address = address
        self.accepted_at = accepted_at   # the deadline to `open` counts from here
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.done(self.address)


class LogLimiter:
    """Whether to log an event for `key` now: the first at once, then at most one
    every `interval` seconds per key, saying how many were not logged meanwhile.
    At most `max_keys` keys are remembered (the oldest go first)."""

    def __init__(self, interval: float = 10.0, max_keys: int = 10_000):
        self.interval = interval
        self.max_keys = max_keys
        self._keys: dict[str, list[float]] = {}    # key → [logged at, not logged since]

    def check(self, key: str, now: float) -> int | None:
        """None: do not log; else log, with this many left unlogged since the last."""
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return None
        if entry is None and len(self._keys) >= self.max_keys:
            for old in list(self._keys)[:max(1, self.max_keys // 10)]:
                del self._keys[old]
        skipped = 0 if entry is None else int(entry[1])
        self._keys.pop(key, None)
        self._keys[key] = [now, 0]
        return skipped


__all__ = ["HandshakeGate", "HandshakeSlot", "LogLimiter"]
