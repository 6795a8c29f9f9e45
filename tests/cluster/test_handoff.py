"""The hand-off's reading of a connection's bytes (cluster/handoff.py): where the AMQP
layer starts after SASL in each direction, heartbeats, the signed message."""

from __future__ import annotations

import struct

import pytest

from amqpbroker.cluster.handoff import decode_message, encode_message
from amqpbroker.core.handoff import AMQP_HEADER, SASL_HEADER, amqp_start, has_empty_frame


def frame(body: bytes, kind: int = 0) -> bytes:
    return struct.pack(">IBBH", 8 + len(body), 2, kind, 0) + body


def test_amqp_start_without_sasl():
    assert amqp_start(AMQP_HEADER + frame(b"open")) == 0
    assert amqp_start(b"", written=True) == 0            # nothing written yet
    assert amqp_start(b"") is None                       # the client's header not there yet


def test_amqp_start_after_sasl_frames():
    sasl = SASL_HEADER + frame(b"init", 1) + frame(b"response", 1)
    assert amqp_start(sasl + AMQP_HEADER + frame(b"open")) == len(sasl)
    assert amqp_start(sasl) is None                               # input: the header must come
    assert amqp_start(sasl, written=True) == len(sasl)            # output: nothing of AMQP written yet
    assert amqp_start(sasl[:-3], written=True) is None            # a frame cut short: not understood


def test_heartbeats_in_written_output_are_seen():
    assert has_empty_frame(AMQP_HEADER + frame(b"open") + struct.pack(">IBBH", 8, 2, 0, 0))
    assert not has_empty_frame(AMQP_HEADER + frame(b"open") + frame(b"begin"))


def test_the_message_is_signed():
    raw = encode_message(b"k" * 32, {"user": "alice"}, b"replay", b"sent")
    assert decode_message(b"k" * 32, raw) == ({"user": "alice"}, b"replay", b"sent")
    with pytest.raises(ValueError):
        decode_message(b"x" * 32, raw)
    with pytest.raises(ValueError):
        decode_message(b"k" * 32, raw[:40] + b"!" + raw[41:])


def test_a_silent_hand_off_peer_stalls_nothing_and_a_forged_message_is_refused(caplog, tmp_path):
    """A local process that connects to a worker's hand-off socket and sends nothing
    must not hold the worker's loop: a second (forged) hand-off behind it is read and
    refused while the first still waits, and its socket is closed, not adopted."""
    import asyncio
    import os
    import socket
    import types

    from amqpbroker.cluster.handoff import HandoffListener, send_socket

    path = "\0amqpbroker-test-handoff-" + os.urandom(6).hex()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        listener = HandoffListener(types.SimpleNamespace(loop=loop), path, b"k" * 32, lambda name: None)
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            silent.connect(path)
            await asyncio.sleep(0)                   # accepted, its message waited for
            a, b = socket.socketpair()
            forged = encode_message(b"x" * 32, {"listener": "amqp"}, b"", b"")
            await loop.run_in_executor(None, send_socket, path, forged, a.fileno())
            a.close()
            for _ in range(200):
                if "wrong HMAC" in caplog.text:
                    break
                await asyncio.sleep(0.01)
            assert "wrong HMAC" in caplog.text
            assert "receive failed" not in caplog.text   # the silent one was not waited out first
            assert listener.adopted_total == 0
            b.settimeout(10)
            assert b.recv(1) == b""                  # the passed socket's every copy closed
            b.close()
        finally:
            silent.close()
            listener.close()

    with caplog.at_level("WARNING", logger="amqpbroker.cluster"):
        asyncio.run(scenario())
