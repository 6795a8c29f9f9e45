"""AMQP over WebSocket end to end: rhea's WebSocket transport (Node, `ws`) against
the broker's `[websocket]` listener, plain and TLS; the same SASL and ACLs as TCP;
an upgrade without the `amqp` subprotocol refused with a reason and a log line."""

from __future__ import annotations

import base64
import os
import socket
import uuid

import pytest
from proton import Message

from tests.client import connect
from tests.e2e.helpers_conn import make_self_signed
from tests.e2e.websocket_support import rhea_round_trip

pytestmark = pytest.mark.e2e


def uniq(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def upgrade_request(port: int, subprotocol: str | None, origin: str | None = None,
                    host: str | None = None) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    lines = ["GET / HTTP/1.1", f"Host: {host or f'127.0.0.1:{port}'}", "Upgrade: websocket",
             "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    if subprotocol:
        lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
    if origin:
        lines.append(f"Origin: {origin}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def http_answer(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while not _complete(data):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


def _complete(data: bytes) -> bool:
    """Headers read, and the body its content-length announces (none for a 101)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def test_rhea_over_websocket_sends_and_receives(broker_factory):
    b = broker_factory("[websocket]\nport = 0\n")
    q = uniq("ws")
    result = rhea_round_trip(f"ws://127.0.0.1:{b.ports['ws']}/", q, 50)
    assert result["error"] is None
    assert result["received"] == [f"ws-{i}" for i in range(50)]
    assert "user=anonymous" in b.wait_for_log(r"connection open: .*container=ws-")
    # A message from a TCP client on the same queue: one broker model behind both listeners.
    conn = connect(b.url)
    try:
        conn.create_sender(q).send(Message(body="from tcp"))
    finally:
        conn.close()
    ws = rhea_round_trip(f"ws://127.0.0.1:{b.ports['ws']}/", q, 2)
    assert ws["error"] is None and ws["received"][:2] == ["from tcp", "ws-0"]


def test_rhea_over_tls_websocket(broker_factory, tmp_path):
    cert, key = make_self_signed(tmp_path)
    b = broker_factory(f'[websocket]\nport = 0\ncert_file = "{cert}"\nkey_file = "{key}"\n')
    result = rhea_round_trip(f"wss://127.0.0.1:{b.ports['wss']}/", uniq("wss"), 10)
    assert result["error"] is None and len(result["received"]) == 10
    assert "wss listening on" in b.log_text()


def test_sasl_and_acls_apply_over_websocket(broker_factory):
    b = broker_factory("""
allow_anonymous = false
[websocket]
port = 0
[users.alice]
password = "alice-pw"
[[acl]]
user = "alice"
pattern = "orders.#"
permissions = ["send", "consume"]
""")
    url = f"ws://127.0.0.1:{b.ports['ws']}/"
    ok = rhea_round_trip(url, "orders.ws", 5, "alice", "alice-pw")
    assert ok["error"] is None and len(ok["received"]) == 5
    denied = rhea_round_trip(url, "secret.ws", 1, "alice", "alice-pw")
    assert "amqp:unauthorized-access" in denied["error"]
    b.wait_for_log(r"access denied: user 'alice' is not allowed to consume on 'secret.ws'")
    wrong = rhea_round_trip(url, "orders.ws", 1, "alice", "nope")
    assert wrong["error"] is not None and wrong["received"] == []
    b.wait_for_log(r"refused during SASL: authentication failed for user 'alice' \(PLAIN\)")
    anonymous = rhea_round_trip(url, "orders.ws", 1)
    assert anonymous["error"] is not None and anonymous["received"] == []


def test_upgrade_without_amqp_subprotocol_is_refused(broker_factory):
    b = broker_factory("[websocket]\nport = 0\n")
    port = b.ports["ws"]
    answer = http_answer(port, upgrade_request(port, "mqtt"))
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"the WebSocket subprotocol 'amqp' is required (offered: mqtt)" in answer
    b.wait_for_log(r"ws: upgrade request from 127\.0\.0\.1:\d+ refused: the WebSocket subprotocol 'amqp' "
                   r"is required \(offered: mqtt\)")
    accepted = http_answer(port, upgrade_request(port, "amqp"))
    assert accepted.startswith(b"HTTP/1.1 101") and b"sec-websocket-protocol: amqp" in accepted.lower()
    # Not HTTP at all: a protocol error, logged; the broker serves the next client.
    garbage = http_answer(port, b"AMQP\x00\x01\x00\x00\r\n\r\n")
    assert not garbage.startswith(b"HTTP/1.1 101")
    b.wait_for_log(r"ws: WebSocket protocol error from 127\.0\.0\.1")
    assert rhea_round_trip(f"ws://127.0.0.1:{port}/", uniq("ws"), 1)["error"] is None


def test_a_page_from_another_origin_is_refused(broker_factory):
    """A browser sends the page's Origin on the upgrade; any page could otherwise read
    every message of an anonymous loopback broker (cross-site WebSocket hijacking)."""
    b = broker_factory("[websocket]\nport = 0\n")
    port = b.ports["ws"]
    refused = http_answer(port, upgrade_request(port, "amqp", origin="http://evil.example"))
    assert refused.startswith(b"HTTP/1.1 403"), refused[:200]
    assert b"http://evil.example may not connect" in refused
    b.wait_for_log(r"ws: upgrade request from 127\.0\.0\.1:\d+ refused: a page from http://evil\.example "
                   r"may not connect")
    # Clients that are not browsers send no Origin: they connect as before.
    assert http_answer(port, upgrade_request(port, "amqp")).startswith(b"HTTP/1.1 101")


def test_allowed_origins_and_same_host(broker_factory):
    b = broker_factory('[websocket]\nport = 0\nallowed_origins = ["https://app.example.com", "same-host"]\n')
    port = b.ports["ws"]

    def status(origin: str, host: str | None = None) -> bytes:
        return http_answer(port, upgrade_request(port, "amqp", origin=origin, host=host))[:12]

    assert status("https://app.example.com") == b"HTTP/1.1 101"
    assert status("https://APP.example.com:443") == b"HTTP/1.1 101"          # the same origin (RFC 6454)
    assert status("https://app.example.com:8443") == b"HTTP/1.1 403"
    assert status("http://app.example.com") == b"HTTP/1.1 403"
    assert status("http://127.0.0.1:8080") == b"HTTP/1.1 101"                 # same host, another port
    assert status("http://localhost:8080", host=f"localhost:{port}") == b"HTTP/1.1 101"
    # A name the page's owner controls could be rebound to 127.0.0.1: never "same host".
    assert status("http://evil.example", host=f"evil.example:{port}") == b"HTTP/1.1 403"
    assert status("null") == b"HTTP/1.1 403"
