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


__all__ = ["HandshakeGate"]
