"""core/handshakes.py: the gate for sockets before `open`, the slot a TLS socket
takes at accept, and the per-key log limiter."""

from __future__ import annotations

from amqpbroker.core.handshakes import HandshakeGate, HandshakeSlot, LogLimiter


def test_the_gate_counts_in_all_and_per_address():
    gate = HandshakeGate(max_total=3, max_per_address=2)
    assert gate.admit("a") is None and gate.admit("a") is None
    assert "from a" in gate.admit("a")
    assert gate.admit("b") is None
    assert "in their handshake" in gate.admit("c")
    gate.done("a")
    assert gate.admit("c") is None
    assert gate.refused_total == 2 and gate.in_progress == 3


def test_a_slot_is_given_back_once():
    gate = HandshakeGate(max_total=10, max_per_address=1)
    slot = gate.slot("a", 5.0)
    assert isinstance(slot, HandshakeSlot) and slot.accepted_at == 5.0
    assert isinstance(gate.slot("a", 6.0), str)          # refused: the reason
    slot.release()
    slot.release()                                       # the TLS layer and the AMQP layer both end it
    assert gate.in_progress == 0 and gate.addresses() == 0
    other = gate.slot("a", 7.0)
    assert isinstance(other, HandshakeSlot)
    slot.release()                                       # a late release of the old slot takes nothing
    assert gate.in_progress == 1


def test_the_log_limiter_logs_once_per_key_and_interval():
    limiter = LogLimiter(interval=10.0, max_keys=3)
    assert limiter.check("a", 0.0) == 0
    assert limiter.check("a", 1.0) is None and limiter.check("a", 2.0) is None
    assert limiter.check("b", 2.0) == 0                  # another key is not held back
    assert limiter.check("a", 10.5) == 2                 # and says how many were not logged
    for key in "cdefg":
        limiter.check(key, 11.0)
    assert len(limiter._keys) <= 3
