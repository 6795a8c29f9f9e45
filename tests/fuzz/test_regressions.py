"""Broker bugs the fuzzers found, each as the smallest reproduction: the exact
bytes, against the real broker (or the pure codec).  All of them are fixed and
these tests pass.  A new finding comes in as `xfail(strict=True)` with a matching
entry in tests/fuzz/known.py (the fuzz run's list of known findings) and loses
both together with its fix (a strict xfail fails the suite once it passes).
"""

from __future__ import annotations

import struct
import time

import pytest
from proton import Delivery, Described, Terminus, int32, symbol, uint, ulong
from proton import Message as ProtonMessage

from amqpbroker.core import codec
from tests.e2e.helpers_conn import AMQP_HEADER, SASL_HEADER, RawClient, amqp_frame
from tests.e2e.helpers_delivery import connection, send_bodies, uid

from tests.e2e.canary import Canary

from . import values
from .messages import drain
from .wire import converse

pytestmark = pytest.mark.e2e

BAD_UTF8 = b"\xff\xfe\xfd\xfc"
HANDSHAKE = SASL_HEADER + amqp_frame(0, 0x41, [symbol("ANONYMOUS"), b""], frame_type=1) + AMQP_HEADER


def perf(code: int, fields: list, channel: int = 0, payload: bytes = b"") -> bytes:
    """A frame whose performative is encoded by tests/fuzz/values.py: any field value."""
    body = b"\x00\x53" + bytes((code,)) + values.encode(fields) + payload
    return struct.pack(">IBBH", 8 + len(body), 2, 0, channel) + body


OPEN = perf(0x10, ["fuzz-regression"])
BEGIN = perf(0x11, [None, uint(0), uint(100), uint(100)])
LIST_KEYED_MAP = values.raw_map([(values.encode([1]), values.encode(1))])


def tracebacks(broker, since: int) -> list[str]:
    return [line for line in broker.lines[since:] if "Traceback" in line]


def assert_answered_cleanly(broker, before: int, case) -> None:
    """What every hostile frame deserves: an answer (the connection goes on, or is
    closed with a close frame carrying an error condition other than
    internal-error), and no traceback in the broker's log."""
    assert case.outcome == "usable" or (case.outcome.startswith("closed:")
                                         and case.outcome not in ("closed:no-condition",
                                                                  "closed:amqp:internal-error")), case.outcome
    assert not tracebacks(broker, before), "".join(broker.lines[before:])


# --------------------------------------------------------------------------- the codec


def test_codec_map_with_an_unhashable_key_raises_decode_error():
    for raw in (b"\xc1\x03\x02\x45\x40",                     # {[]: null}
                b"\xc1\x05\x02\xc1\x01\x00\x40",             # {{}: null}
                b"\xc1\x06\x02\x00\x53\x01\x40\x40"):        # {D(1, null): null}
        try:
            codec.decode(raw)
        except codec.DecodeError:
            continue
        except TypeError as exc:
            pytest.fail(f"{raw.hex()}: {exc!r}")


def test_codec_truncated_decimal128_raises_decode_error():
    with pytest.raises(codec.DecodeError):
        codec.decode(b"\x94\x00")


# --------------------------------------------------------------------------- the frame guard (core/wire.py)


def test_performative_with_a_map_keyed_by_a_list(broker):
    before = len(broker.lines)
    begin = perf(0x11, [None, uint(0), uint(100), uint(100), None, None, None, LIST_KEYED_MAP])   # properties
    case = converse(broker.port, [HANDSHAKE + OPEN, begin], "begin properties {[1]: 1}")
    assert_answered_cleanly(broker, before, case)


def test_detach_with_a_handle_that_is_a_list(broker):
    before = len(broker.lines)
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, perf(0x16, [[1], True])], "detach handle [1]")
    assert_answered_cleanly(broker, before, case)


def test_frame_body_cut_after_the_descriptor_constructor(broker):
    before = len(broker.lines)
    frame = struct.pack(">IBBH", 10, 2, 0, 0) + b"\x00\x53"
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, frame], "body 00 53")
    assert_answered_cleanly(broker, before, case)


def test_frame_header_with_a_bad_data_offset_is_refused_at_once(broker):
    before = len(broker.lines)
    header = struct.pack(">IBBH", 5000, 0, 0, 0) + b"\x00\x53\x13\x45"
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, header], "size 5000, doff 0")
    assert case.outcome.startswith("closed:"), case.outcome
    assert not tracebacks(broker, before)


def test_a_begin_before_the_open_is_refused_at_once(broker):
    before = len(broker.lines)
    case = converse(broker.port, [HANDSHAKE + BEGIN], "begin, no open")
    assert case.outcome.startswith("closed:"), case.outcome
    assert not tracebacks(broker, before)


# --------------------------------------------------------------------------- messages


def _send_raw(broker, raw: bytes, *, txn=None):
    """Send one message; (its outcome, the connection's condition or None)."""
    client = RawClient("127.0.0.1", broker.port).wait_open()
    snd = client.sender(client.session(), uid("fuzz-regression"), "s")
    dlv = snd.delivery(b"1")
    snd.send(raw)
    if txn is not None:
        dlv.local.data = [txn]
        dlv.update(0x34)          # transactional-state
    snd.advance()
    try:
        client.wait(lambda: dlv.remote_state or client.conn.state & client.conn.REMOTE_CLOSED
                    or client.socket_closed, 3, "an outcome")
    except AssertionError:
        pass
    cond = client.conn.remote_condition or client.transport.condition
    outcome = dlv.remote_state
    client.close()
    return outcome, (cond.name if cond else None)


def _section(code: int, value: bytes) -> bytes:
    return b"\x00\x53" + bytes((code,)) + value


BODY = _section(0x77, b"\xa1\x02ok")
DELAY_KEY = values.encode(symbol("x-opt-delivery-delay"))


@pytest.mark.parametrize("raw", [
    _section(0x70, values.encode([LIST_KEYED_MAP])) + BODY,                           # header durable
    _section(0x73, values.encode([None] * 10 + [LIST_KEYED_MAP])) + BODY,             # properties group-id
    _section(0x72, values.raw_map([(values.encode([1]), values.encode(1)),
                                   (DELAY_KEY, values.encode(5))]).raw) + BODY,       # annotations
], ids=["header", "properties", "message-annotations"])
def test_message_section_with_a_map_keyed_by_a_list(broker, raw):
    before = len(broker.lines)
    outcome, closed = _send_raw(broker, raw)
    assert outcome in (Delivery.ACCEPTED, Delivery.REJECTED) and closed is None, (outcome, closed)
    assert not tracebacks(broker, before)


# --------------------------------------------------------------------------- transactions


@pytest.mark.parametrize("txn", [Described(ulong(1), None), int32(-1), ulong(2**63), uint(100_000)],
                         ids=["described", "negative", "huge", "uint-100000"])
def test_transfer_with_a_txn_id_that_is_not_binary(broker, txn):
    before = len(broker.lines)
    outcome, closed = _send_raw(broker, BODY, txn=txn)
    assert outcome and closed is None, (outcome, closed)
    assert not tracebacks(broker, before)


def test_discharge_with_a_txn_id_that_is_not_binary(broker):
    before = len(broker.lines)
    client = RawClient("127.0.0.1", broker.port).wait_open()
    ssn = client.conn.session()
    ssn.open()
    ctl = ssn.sender("txn-ctrl")
    ctl.target.type = Terminus.COORDINATOR
    ctl.target.capabilities.put_object(symbol("amqp:local-transactions"))
    ctl.open()
    client.wait(lambda: ctl.state & ctl.REMOTE_ACTIVE, 5, "coordinator attach")
    dlv = ctl.delivery(b"d")
    ctl.send(ProtonMessage(body=Described(ulong(0x32), [Described(ulong(1), None), False])).encode())
    ctl.advance()
    client.wait(lambda: dlv.remote_state or client.conn.state & client.conn.REMOTE_CLOSED, 3, "discharge outcome")
    closed = client.conn.remote_condition
    client.close()
    assert dlv.remote_state == Delivery.REJECTED and closed is None, (dlv.remote_state, closed)
    assert not tracebacks(broker, before)


def test_transactional_acknowledgement_with_a_txn_id_that_is_not_binary(broker):
    q = uid("fuzz-txn-ack")
    with connection(broker) as conn:
        send_bodies(conn, q, ["one"])
    before = len(broker.lines)
    attach = perf(0x12, ["r", uint(0), True, None, None, Described(ulong(0x28), [q]), Described(ulong(0x29), [None])])
    flow = perf(0x13, [uint(0), uint(100), uint(0), uint(100), uint(0), uint(0), uint(10)])
    state = Described(ulong(0x34), [Described(ulong(1), None), Described(ulong(0x24), [])])
    disposition = perf(0x15, [True, uint(0), None, True, state])
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, attach + flow, disposition], "txn ack")
    assert_answered_cleanly(broker, before, case)


# --------------------------------------------------------------------------- links


def test_detach_of_a_link_refused_for_its_name(broker):
    before = len(broker.lines)
    attach = perf(0x12, [values.Raw(b"\xa1\x04" + BAD_UTF8), uint(0), False, None, None,
                         Described(ulong(0x28), [None]), Described(ulong(0x29), ["fuzz.q"])])
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, attach, perf(0x16, [uint(0), True])],
                    "attach name ff fe fd fc, then detach")
    assert_answered_cleanly(broker, before, case)


DEEP = values.deep("list", 1000)        # a list in a list ... 1,000 deep


@pytest.mark.parametrize("frames", [
    [perf(0x10, ["deep", None, None, None, None, None, None, None, None, DEEP])],
    [OPEN + BEGIN, perf(0x12, ["r", uint(0), True, None, None, Described(ulong(0x28), ["q"] + [None] * 6 + [DEEP]),
                               Described(ulong(0x29), [None])])],
    [OPEN + BEGIN, perf(0x12, ["s", uint(0), False, None, None, Described(ulong(0x28), [None]),
                               Described(ulong(0x29), ["q"] + [None] * 5 + [DEEP])])],
], ids=["open-properties", "source-filter", "target-capabilities"])
def test_performative_field_nested_1000_deep(broker, frames):
    before = len(broker.lines)
    case = converse(broker.port, [HANDSHAKE + frames[0]] + frames[1:], "nested 1,000 deep")
    assert_answered_cleanly(broker, before, case)


# A stall the attack causes shows once per attack in the canary: several attacks, a
# canary round trip apart or more, make it several slow round trips (a busy machine
# makes one now and then, the control canary's too: tests/e2e/canary.py).
ATTACKS = 5


def attacked(broker, control_broker, turns: list[bytes], note: str) -> list[str]:
    """Send the conversation ATTACKS times, each on a connection of its own, with a
    canary on the broker and a control canary on an idle one; the outcomes.  Fails
    when the canary was slowed beyond what the machine did to the control."""
    outcomes = []
    with Canary(control_broker) as control, Canary(broker) as canary:
        for _ in range(ATTACKS):
            time.sleep(0.2)
            outcomes.append(converse(broker.port, turns, note).outcome)
        time.sleep(0.5)
    print(f"{note}: canary {canary.report.summary()}; control {control.report.summary()}")
    canary.assert_like(control)
    return outcomes


def test_zero_width_array_in_an_attach_does_not_stall_the_broker(broker, control_broker):
    caps = values.Raw(b"\xf0" + struct.pack(">II", 5, 2_977_210) + b"\x44")     # ulong 0, 2,977,210 times
    attaches = b"".join(perf(0x12, [f"r{i}", uint(i), True, None, None,
                                    Described(ulong(0x28), [uid("q")] + [None] * 9 + [caps]),
                                    Described(ulong(0x29), [None])]) for i in range(5))
    outcomes = attacked(broker, control_broker, [HANDSHAKE + OPEN + BEGIN, attaches], "5 attaches, 2,977,210 ulong0")
    for outcome in outcomes:
        assert outcome == "usable" or outcome.startswith("closed:amqp:"), outcome


def nested_zero_width_arrays(outer: int) -> values.Raw:
    """An array of `outer` arrays, each declaring as many nulls as the whole
    buffer has bytes (what codec's zero-width guard lets through, per array):
    9 bytes per inner array, so outer * 9 * outer elements from outer * 9 bytes."""
    count = 9 * outer + 10
    inner = struct.pack(">II", 5, count) + b"\x40"
    body = b"\xf0" + inner * outer
    return values.Raw(b"\xf0" + struct.pack(">II", 4 + len(body), outer) + body)


def test_nested_zero_width_arrays_do_not_stall_the_broker(broker, control_broker):
    attach = perf(0x12, ["r", uint(0), True, None, None, Described(ulong(0x28), [uid("q")]),
                         Described(ulong(0x29), [None]), None, None, None, None, None, None,
                         nested_zero_width_arrays(1200)])                  # properties
    outcomes = attacked(broker, control_broker, [HANDSHAKE + OPEN + BEGIN, attach],
                        "attach properties: 1,200 x 10,810 nulls")
    for outcome in outcomes:
        assert outcome == "usable" or outcome.startswith("closed:amqp:"), outcome


def test_subscription_attach_with_a_null_name(broker):
    before = len(broker.lines)
    caps = values.Raw(b"\xe0\x0f\x02\xa3\x05topic\x06shared")        # array8 of two symbols
    attach = perf(0x12, [None, uint(0), True, None, None,
                         Described(ulong(0x28), ["fuzz.topic", uint(2), symbol("never"), uint(0), False, None,
                                                 symbol("copy"), None, None, None, caps]),
                         Described(ulong(0x29), [None])])
    case = converse(broker.port, [HANDSHAKE + OPEN + BEGIN, attach], "attach name null, shared durable topic")
    assert_answered_cleanly(broker, before, case)


# --------------------------------------------------------------------------- the store


def test_durable_transfer_then_detach_and_end_before_the_commit(broker_factory):
    broker = broker_factory()
    q = uid("fuzz-durable")
    head = HANDSHAKE + OPEN + BEGIN + perf(0x12, ["snd", uint(0), False, None, None, Described(ulong(0x28), ["s"]),
                                                  Described(ulong(0x29), [q])])
    durable = _section(0x70, values.encode([True])) + BODY
    tail = (perf(0x14, [uint(0), uint(0), b"t", uint(0)], payload=durable)
            + perf(0x16, [uint(0), True]) + perf(0x17, []))
    for _ in range(300):
        if broker.proc.poll() is not None:
            break
        # The tail goes once begin and attach are answered (the session's window is
        # open), without waiting for the transfer's outcome.
        converse(broker.port, [head, tail], "durable transfer, detach, end")
    time.sleep(0.2)
    assert broker.proc.poll() is None, f"broker exited with {broker.proc.returncode}:\n" + "".join(broker.lines[-20:])


# --------------------------------------------------------------------------- selectors


def test_a_selecting_consumer_does_not_stall_the_broker(broker, control_broker):
    q = uid("fuzz-selector-scan")
    client = RawClient("127.0.0.1", broker.port).wait_open()
    snd = client.sender(client.session(), q, "fill")
    sent = []
    for i in range(2000):
        dlv = snd.delivery(str(i).encode())
        snd.send(ProtonMessage(body="x", properties={"colour": "blue" if i < 1000 else "red"}).encode())
        snd.advance()
        sent.append(dlv)
        if i % 100 == 0:
            client.pump(0)
    client.wait(lambda: all(d.remote_state for d in sent), 30, "the queue filled")
    client.close()
    with Canary(control_broker) as control, Canary(broker) as canary:
        time.sleep(0.2)
        got = drain(broker.port, q, "colour = 'red'", quiet=3.0)
        time.sleep(0.2)
    assert len(got) == 1000
    canary.assert_like(control)
