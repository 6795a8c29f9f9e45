"""ha/wire.py: framing and the secret handshake, over a real local socket."""

import asyncio

import pytest

from amqpbroker.ha import wire


async def _prove(side: str, proof, reader, writer, secret: str, results: dict) -> None:
    """One side's half of the handshake: "ok" or the exception's name in results."""
    try:
        await proof(reader, writer, secret)
        results[side] = "ok"
    except (wire.HandshakeFailed, asyncio.IncompleteReadError) as exc:
        results[side] = type(exc).__name__
    writer.close()


async def _pair(live_secret: str, backup_secret: str):
    results = {}

    async def serve(reader, writer):
        await _prove("live", wire.prove_live, reader, writer, live_secret, results)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _prove("backup", wire.prove_backup, reader, writer, backup_secret, results)
    await asyncio.sleep(0.05)
    server.close()
    return results


def test_both_sides_prove_the_secret():
    assert asyncio.run(_pair("s" * 20, "s" * 20)) == {"live": "ok", "backup": "ok"}


def test_a_backup_without_the_secret_is_refused():
    assert asyncio.run(_pair("s" * 20, "t" * 20))["live"] == "HandshakeFailed"


def test_frames_round_trip():
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(wire.frame(wire.BATCH, b"abc") + wire.ack_frame(-1) + wire.ack_frame(41))
        reader.feed_eof()
        out = [await wire.read_frame(reader) for _ in range(3)]
        return out
    (k1, p1), (k2, p2), (k3, p3) = asyncio.run(run())
    assert (k1, p1) == (wire.BATCH, b"abc")
    assert k2 == wire.ACK and wire.ack_number(p2) == -1
    assert wire.ack_number(p3) == 41


def test_an_oversized_frame_is_refused():
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(wire.HEAD.pack(wire.MAX_FRAME + 1, wire.BATCH))
        reader.feed_eof()
        await wire.read_frame(reader)
    with pytest.raises(ValueError):
        asyncio.run(run())
