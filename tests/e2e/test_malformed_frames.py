"""End-to-end: performative fields a broken or hostile peer sends — invalid UTF-8, a
symbol that is not ASCII, a field of the wrong type — close only the connection or
link that carried them, with `amqp:decode-error` / `amqp:invalid-field` and one log
line, never `amqp:internal-error` or a traceback; the broker keeps serving."""

from __future__ import annotations

import select
import socket
import time

import pytest
from proton import Described, symbol, uint, ulong

from tests.e2e.helpers_conn import AMQP_HEADER, SASL_HEADER, amqp_frame
from tests.e2e.helpers_delivery import connection, drain_bodies, receiver, send_bodies, uid

pytestmark = pytest.mark.e2e

BAD_UTF8 = b"\xff\xfe\xfd\xfc"
SELECTOR = 0x0000468C00000004


def frame(code: int, fields: list, patch: tuple[bytes, bytes] | None = None) -> bytes:
    raw = amqp_frame(0, code, fields)
    if patch is not None:
        placeholder, replacement = patch
        assert raw.count(placeholder) == 1 and len(placeholder) == len(replacement)
        raw = raw.replace(placeholder, replacement)
    return raw


OPEN = frame(0x10, ["malformed-frames"])
BEGIN = frame(0x11, [None, uint(0), uint(100), uint(100)])


def attach(name: str, *, sender: bool, source: list, target: list, patch=None) -> bytes:
    # role: True = receiver (the broker sends), False = sender
    return frame(0x12, [name, uint(0), not sender, None, None, Described(ulong(0x28), source),
                        Described(ulong(0x29), target)], patch)


CASES = {
    # connection level: the connection is closed with the condition
    "open container-id invalid UTF-8": ([frame(0x10, ["XXXX"], (b"XXXX", BAD_UTF8))], b"amqp:decode-error"),
    "open hostname invalid UTF-8": ([frame(0x10, ["c", "HHHH"], (b"HHHH", BAD_UTF8))], b"amqp:decode-error"),
    "open desired-capabilities an int": ([frame(0x10, ["c"] + [None] * 7 + [5])], b"amqp:invalid-field"),
    "open properties non-ASCII symbol key": (
        [frame(0x10, ["c"] + [None] * 8 + [{symbol("KKKK"): 1}], (b"KKKK", b"\xc3\xa9KK"))], b"amqp:decode-error"),
    # link level: the link is refused (null terminus + detach with the condition)
    "attach name invalid UTF-8": (
        [OPEN, BEGIN, attach("NNNN", sender=True, source=["q"], target=["q"], patch=(b"NNNN", BAD_UTF8))],
        b"amqp:decode-error"),
    "attach source address invalid UTF-8": (
        [OPEN, BEGIN, attach("l", sender=False, source=["AAAA"], target=[None], patch=(b"AAAA", BAD_UTF8))],
        b"amqp:decode-error"),
    "attach target address invalid UTF-8": (
        [OPEN, BEGIN, attach("l", sender=True, source=[None], target=["TTTT"], patch=(b"TTTT", BAD_UTF8))],
        b"amqp:decode-error"),
    "attach source capability non-ASCII symbol": (
        [OPEN, BEGIN, attach("l", sender=False, source=["q"] + [None] * 9 + [symbol("CCCC")], target=[None],
                             patch=(b"CCCC", b"\xc3\xa9CC"))], b"amqp:decode-error"),
    "attach selector invalid UTF-8": (
        [OPEN, BEGIN, attach("l", sender=False, target=[None],
                             source=["q"] + [None] * 6 + [{symbol("jms-selector"): Described(ulong(SELECTOR), "SSSS")}],
                             patch=(b"SSSS", BAD_UTF8))], b"amqp:decode-error"),
    "attach selector an int": (
        [OPEN, BEGIN, attach("l", sender=False, target=[None],
                             source=["q"] + [None] * 6 + [{symbol("jms-selector"): Described(ulong(SELECTOR), 5)}])],
        b"amqp:invalid-field"),
}


def exchange(port: int, frames: list[bytes], timeout: float = 5.0) -> bytes:
    """SASL ANONYMOUS, the AMQP header, the frames; everything the broker sends back
    until it closes the socket or goes quiet (raw bytes: a reply may echo the
    undecodable field, which no client library would hand out)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(SASL_HEADER + amqp_frame(0, 0x41, [symbol("ANONYMOUS"), b""], frame_type=1) + AMQP_HEADER)
    for f in frames:
        s.sendall(f)
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([s], [], [], 0.5)
        if not r:
            if b"\x00\x53\x16" in got or b"\x00\x53\x18" in got:   # a detach or a close came
                break
            continue
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_fields_get_a_protocol_error_not_an_internal_one(broker, name):
    frames, condition = CASES[name]
    before = len(broker.lines)
    reply = exchange(broker.port, frames)
    assert condition in reply, reply
    assert b"amqp:internal-error" not in reply
    assert not any("Traceback" in line for line in broker.lines[before:])
    # The broker keeps serving everyone else.
    q = uid("after-malformed")
    with connection(broker) as conn:
        send_bodies(conn, q, ["still here"])
        assert drain_bodies(conn, receiver(conn, q)) == ["still here"]
    assert any(condition.decode() in line for line in broker.lines[before:]), "no log line"


def test_a_refused_link_leaves_its_connection_usable(broker):
    """A link with a bad field is refused; the other links of the connection go on."""
    q = uid("same-conn")
    bad = attach("bad", sender=False, source=["AAAA"], target=[None], patch=(b"AAAA", BAD_UTF8))
    good = frame(0x12, ["good", uint(1), False, None, None, Described(ulong(0x28), [None]),
                        Described(ulong(0x29), [q])])
    flow_wait = exchange(broker.port, [OPEN, BEGIN, bad, good], timeout=3)
    assert b"amqp:decode-error" in flow_wait
    assert b"\x00\x53\x18" not in flow_wait          # no close: only the link went
    assert flow_wait.count(b"\x00\x53\x12") == 2     # both attaches answered


# --------------------------------------------------------------------------- extreme but valid fields


@pytest.mark.parametrize("credit", [2**31, 2**32 - 1])
def test_credit_of_two_to_the_31_or_more_is_served(broker, credit):
    """link-credit is a uint (AMQP 1.0 §2.7.4): the whole range is served."""
    q = uid("big-credit")
    with connection(broker) as conn:
        send_bodies(conn, q, ["one", "two"])
    rcv = attach("big", sender=False, source=[q], target=[None])
    flow = frame(0x13, [uint(0), uint(100), uint(0), uint(100), uint(0), uint(0), uint(credit)])
    reply = exchange(broker.port, [OPEN, BEGIN, rcv, flow], timeout=3)
    assert reply.count(b"\x00\x53\x14") == 2, "both messages transferred"


@pytest.mark.parametrize("properties", ["a list", "a non-ASCII symbol key"])
def test_link_properties_that_do_not_read_as_a_map_are_ignored(broker, properties):
    """A consumer's link properties are read for `amqpbroker:standby` (server/attach.py):
    a field of the wrong type, or one that does not decode, asks for nothing; the
    consumer is served, the connection stays (no amqp:internal-error)."""
    q = uid("odd-properties")
    with connection(broker) as conn:
        send_bodies(conn, q, ["one", "two"])
    fields = ["odd", uint(0), True, None, None, Described(ulong(0x28), [q]), Described(ulong(0x29), [None]),
              None, None, None, None, None, None]
    if properties == "a list":
        rcv = frame(0x12, fields + [[1, 2]])
    else:
        rcv = frame(0x12, fields + [{symbol("KKKK"): True}], (b"KKKK", b"\xc3\xa9KK"))
    flow = frame(0x13, [uint(0), uint(100), uint(0), uint(100), uint(0), uint(0), uint(10)])
    reply = exchange(broker.port, [OPEN, BEGIN, rcv, flow], timeout=3)
    assert reply.count(b"\x00\x53\x14") == 2, "both messages transferred"
    assert b"amqp:internal-error" not in reply


# --------------------------------------------------------------------------- protocol violations
# proton lets these through; core/wire.py names them and the connection is closed at once
# (not after the idle timeout).

ATTACH_H0 = attach("l1", sender=False, source=["q"], target=[None])
ATTACH_H0_AGAIN = attach("l2", sender=False, source=["q"], target=[None])

VIOLATIONS = {
    "open twice": ([OPEN, OPEN], b"amqp:not-allowed"),
    "begin twice on one channel": ([OPEN, BEGIN, BEGIN], b"amqp:not-allowed"),
    "attach with a handle in use": ([OPEN, BEGIN, ATTACH_H0, ATTACH_H0_AGAIN], b"amqp:session:handle-in-use"),
    "a first frame that does not decode": ([b"\x00\x00\x00\x10\x02\x00\x00\x00" + b"\xff" * 8], None),
}


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_protocol_violations_close_the_connection_at_once(broker, name):
    frames, condition = VIOLATIONS[name]
    started = time.monotonic()
    reply = exchange(broker.port, frames, timeout=5)
    assert time.monotonic() - started < 2, "held open instead of closed"
    if condition is not None:
        assert condition in reply and b"\x00\x53\x18" in reply, reply
    q = uid("after-violation")
    with connection(broker) as conn:
        send_bodies(conn, q, ["still serving"])
        assert drain_bodies(conn, receiver(conn, q)) == ["still serving"]
    assert "Traceback" not in broker.log_text()
