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


def test_batch_frames_carry_their_number_and_the_writer_frame_unread():
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(wire.batch_frame(41, b"writer-frame") + wire.json_frame(wire.HELLO, {"position": 7}))
        reader.feed_eof()
        return [await wire.read_frame(reader) for _ in range(2)]
    (k1, p1), (k2, p2) = asyncio.run(run())
    number, data = wire.batch_payload(p1)
    assert k1 == wire.BATCH and number == 41 and bytes(data) == b"writer-frame"
    assert k2 == wire.HELLO and wire.json_payload(p2) == {"position": 7}


def test_a_json_frame_must_hold_an_object():
    with pytest.raises(ValueError):
        wire.json_payload(b"[1, 2]")


def test_the_handshake_runs_inside_tls(tmp_path):
    from tests.e2e.helpers_conn import make_self_signed
    cert, key = make_self_signed(tmp_path)
    server_ctx, client_ctx = wire.server_context(str(cert), str(key)), wire.client_context(str(cert))
    other = tmp_path / "other"
    other.mkdir()
    wrong_ctx = wire.client_context(str(make_self_signed(other)[0]))

    async def pair(ctx):
        results = {}

        async def serve(reader, writer):
            await _prove("live", wire.prove_live, reader, writer, "s" * 20, results)

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        except OSError as exc:
            results["backup"] = type(exc).__name__
        else:
            await _prove("backup", wire.prove_backup, reader, writer, "s" * 20, results)
        await asyncio.sleep(0.05)
        server.close()
        return results

    assert asyncio.run(pair(client_ctx)) == {"live": "ok", "backup": "ok"}
    assert asyncio.run(pair(wrong_ctx))["backup"] == "SSLCertVerificationError"
