"""Connection-level behaviour of the real broker: Open contents, the client-id
policy, configured limits, negotiated frame size / channel-max, idle timeout and
heartbeats, connection log lines."""

from __future__ import annotations

import re
import select
import time

import pytest
from proton import Endpoint, Message, uint

from amqpbroker import __version__
from tests.broker_process import BrokerProcess
from tests.client import connect, is_null_terminus
from tests.e2e.helpers_conn import (RawClient, amqp_frame, condition_info, read_frames, remote_offered,
                                    remote_properties)

pytestmark = pytest.mark.e2e

SOLE = "sole-connection-for-container"
ACTIVE = Endpoint.REMOTE_ACTIVE
CLOSED = Endpoint.REMOTE_CLOSED

LIMITED_CONFIG = """
[limits]
max_connections = 3
max_sessions_per_connection = 2
max_links_per_connection = 2
max_frame_size = 4096
"""

IDLE_CONFIG = """
[limits]
idle_timeout = 1.0
"""


def _start(tmp_path_factory, name, config):
    return BrokerProcess(tmp_path_factory.mktemp(name) / "data", config=config).start()


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    proc = _start(tmp_path_factory, "limited", LIMITED_CONFIG)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def idle_broker(tmp_path_factory):
    proc = _start(tmp_path_factory, "idle", IDLE_CONFIG)
    yield proc
    proc.stop()


@pytest.fixture
def clients():
    """RawClient factory; every client is closed at the end of the test."""
    made: list[RawClient] = []

    def make(broker, **kw) -> RawClient:
        c = RawClient(broker.host, broker.port, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _is_open(c: RawClient) -> bool:
    return bool(c.conn.state & ACTIVE) and not (c.conn.state & CLOSED)


# ---------------------------------------------------------------------- Open

def test_open_carries_container_id_capabilities_and_properties(broker, clients):
    c = clients(broker, container_id="open-check").wait_open()
    assert _is_open(c)
    assert c.conn.remote_container == "amqpbroker"
    assert remote_offered(c.conn) == {"SHARED-SUBS", "ANONYMOUS-RELAY", "DELAYED_DELIVERY", SOLE}
    props = remote_properties(c.conn)
    assert props.get("product") == "amqpbroker"
    assert props.get("version") == __version__


def test_default_frame_size_and_channel_max(broker, clients):
    c = clients(broker).wait_open()
    assert c.transport.remote_max_frame_size == 65536
    assert c.transport.remote_channel_max == 255


# ---------------------------------------------------------------------- client-id policy

def _assert_refused_as_clientid_clash(c: RawClient) -> None:
    c.wait_closed()
    assert c.conn.state & CLOSED, "expected a Close frame, not just a dropped socket"
    props = remote_properties(c.conn)
    assert props.get("amqp:connection-establishment-failed") is True
    cond = c.conn.remote_condition
    assert cond is not None and cond.name == "amqp:invalid-field"
    assert condition_info(cond) == {"invalid-field": "container-id"}
    # after its Close the broker also drops the socket (no half-open refused peers)
    c.wait(lambda: c.socket_closed, 5, "broker closing the socket")


def test_second_sole_connection_with_same_container_id_is_refused(broker, clients):
    first = clients(broker, container_id="sole-1", desired_capabilities=[SOLE]).wait_open()
    assert _is_open(first)
    second = clients(broker, container_id="sole-1", desired_capabilities=[SOLE]).wait_open()
    _assert_refused_as_clientid_clash(second)
    broker.wait_for_log(r"refused: container-id 'sole-1' is already connected")
    # the first connection is unaffected
    ssn = first.session()
    assert ssn.state & ACTIVE and _is_open(first)


def test_same_container_id_without_sole_capability_is_accepted(broker, clients):
    first = clients(broker, container_id="shared-id", desired_capabilities=[SOLE]).wait_open()
    second = clients(broker, container_id="shared-id").wait_open()
    assert _is_open(first) and _is_open(second)
    assert "amqp:connection-establishment-failed" not in remote_properties(second.conn)


def test_container_id_is_free_again_after_close(broker, clients):
    first = clients(broker, container_id="reuse-id", desired_capabilities=[SOLE]).wait_open()
    assert _is_open(first)
    first.close()
    again = clients(broker, container_id="reuse-id", desired_capabilities=[SOLE]).wait_open()
    assert _is_open(again), again.conn.remote_condition


def test_unrestricted_policy_accepts_duplicate_container_id(broker_factory, clients):
    b = broker_factory('client_id_policy = "unrestricted"\n')
    first = clients(b, container_id="dup", desired_capabilities=[SOLE]).wait_open()
    second = clients(b, container_id="dup", desired_capabilities=[SOLE]).wait_open()
    assert _is_open(first) and _is_open(second), second.conn.remote_condition


# ---------------------------------------------------------------------- limits

def test_configured_frame_size_and_channel_max_are_advertised(limited, clients):
    c = clients(limited).wait_open()
    assert c.transport.remote_max_frame_size == 4096
    assert c.transport.remote_channel_max == 1     # max_sessions_per_connection - 1


def test_message_larger_than_max_frame_size_round_trips(limited):
    body = "x" * 20_000                             # five times the 4096-byte frame size
    conn = connect(limited.url, container_id="big-msg")
    try:
        rcv = conn.create_receiver("frame-size-q")
        conn.create_sender("frame-size-q").send(Message(body=body))
        assert rcv.receive(timeout=10).body == body
        rcv.accept()
    finally:
        conn.close()


def test_connection_limit(limited, clients):
    held = [clients(limited, container_id=f"conn-limit-{i}").wait_open() for i in range(3)]
    assert all(_is_open(c) for c in held)
    extra = clients(limited, container_id="conn-limit-extra").wait_open()
    extra.wait_closed()
    assert extra.conn.remote_condition is not None
    assert extra.conn.remote_condition.name == "amqp:resource-limit-exceeded"
    limited.wait_for_log(r"container conn-limit-extra\) refused: too many connections")
    # the admitted connections keep working, and a freed slot can be reused
    assert held[0].session().state & ACTIVE
    held[1].close()
    late = clients(limited, container_id="conn-limit-late").wait_open()
    assert _is_open(late), late.conn.remote_condition


def test_sessions_up_to_the_limit_and_freed_on_end(limited, clients):
    c = clients(limited, container_id="ssn-limit").wait_open()
    s1, s2 = c.session(), c.session()
    assert s1.state & ACTIVE and s2.state & ACTIVE
    assert s1.remote_condition is None and s2.remote_condition is None
    s1.close()
    c.wait(lambda: s1.state & CLOSED, what="end of s1")
    s3 = c.session()
    assert s3.state & ACTIVE and not (s3.state & CLOSED), s3.remote_condition


def test_begin_beyond_channel_max_is_refused_and_broker_keeps_serving(limited, clients):
    """A peer ignoring channel-max (raw frames) cannot get more sessions than the limit."""
    import socket
    with socket.create_connection((limited.host, limited.port), timeout=5) as s:
        s.sendall(b"AMQP\x00\x01\x00\x00" + amqp_frame(0, 0x10, ["raw-begin"]))
        for ch in range(3):
            s.sendall(amqp_frame(ch, 0x11, [None, uint(0), uint(100), uint(100)]))
        frames = read_frames(s)
    closes = [f for f in frames if f.descriptor == 0x18]
    ends = [f for f in frames if f.descriptor == 0x17]
    errors = [str(f.value[0].value[0]) for f in closes + ends if f.value and f.value[0] is not None]
    assert errors, f"the extra session was not refused: {frames}"
    assert errors[0] in ("amqp:resource-limit-exceeded", "amqp:connection:framing-error")
    other = clients(limited, container_id="after-raw-begin").wait_open()
    assert _is_open(other)


def test_link_limit_refuses_with_null_terminus(limited, clients):
    c = clients(limited, container_id="link-limit").wait_open()
    ssn = c.session()
    r1 = c.receiver(ssn, "link-limit-q", "r1")
    r2 = c.receiver(ssn, "link-limit-q", "r2")
    assert r1.state & ACTIVE and r2.state & ACTIVE
    assert r1.remote_condition is None and r2.remote_condition is None
    r3 = c.receiver(ssn, "link-limit-q", "r3")
    c.wait(lambda: r3.state & CLOSED, what="detach of r3")
    assert is_null_terminus(r3.remote_source)
    assert r3.remote_condition is not None
    assert r3.remote_condition.name == "amqp:resource-limit-exceeded"
    limited.wait_for_log(r"attach of link 'r3' refused: amqp:resource-limit-exceeded")
    s3 = c.sender(ssn, "link-limit-q", "s3")               # the producer side is limited too
    c.wait(lambda: s3.state & CLOSED, what="detach of s3")
    assert is_null_terminus(s3.remote_target)
    assert s3.remote_condition is not None
    assert s3.remote_condition.name == "amqp:resource-limit-exceeded"
    # the connection and its other links survive; a detached link frees its slot
    assert _is_open(c) and not (r1.state & CLOSED)
    r1.close()
    c.wait(lambda: r1.state & CLOSED, what="detach of r1")
    r4 = c.sender(ssn, "link-limit-q", "r4")
    assert r4.state & ACTIVE and not (r4.state & CLOSED), r4.remote_condition


# ---------------------------------------------------------------------- idle timeout

def test_idle_client_with_heartbeats_stays_connected(idle_broker, clients):
    c = clients(idle_broker, container_id="heartbeat-ok", idle_timeout=1.0).wait_open()
    assert 0 < c.transport.remote_idle_timeout <= 1.0
    frames_in, frames_out = c.transport.frames_input, c.transport.frames_output
    c.pump_for(3.5)                                      # idle: no application traffic
    assert _is_open(c) and not c.socket_closed, c.conn.remote_condition
    assert c.transport.condition is None
    assert c.transport.frames_input - frames_in >= 3, "broker sent no heartbeats"
    assert c.transport.frames_output - frames_out >= 3, "client sent no heartbeats"
    assert "container=heartbeat-ok (" not in idle_broker.log_text()
    assert c.session().state & ACTIVE                      # still usable after idling


def test_dead_peer_is_closed_and_its_unsettled_message_released(idle_broker, clients):
    sender = connect(idle_broker.url, container_id="dead-peer-producer")
    try:
        sender.create_sender("dead-peer-q").send(Message(body="orphan"))
    finally:
        sender.close()
    dead = clients(idle_broker, container_id="dead-peer")
    dead.wait_open()
    rcv = dead.receiver(dead.session(), "dead-peer-q", "dead-rcv")
    rcv.flow(1)
    dead.wait(lambda: rcv.current is not None and not rcv.current.partial, what="delivery")
    assert not rcv.current.settled
    # The peer goes silent: it neither reads nor writes any more.
    went_silent = time.monotonic()
    line = idle_broker.wait_for_log(r"connection closed: .* container=dead-peer \(", timeout=8)
    assert time.monotonic() - went_silent < 6
    assert "idle" in line.lower(), line
    # the broker also closes the socket (EOF after whatever it had written)
    eof = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r, _, _ = select.select([dead.sock], [], [], deadline - time.monotonic())
        if r and dead.sock.recv(65536) == b"":
            eof = True
            break
    assert eof, "broker did not close the socket of the dead peer"
    dead.abandon()
    # the unsettled message is available to another consumer
    other = connect(idle_broker.url, container_id="dead-peer-heir", heartbeat=1)
    try:
        msg = other.create_receiver("dead-peer-q").receive(timeout=10)
        # A lost connection counts what it held as a failed attempt (JMSRedelivered).
        assert (msg.body, msg.delivery_count) == ("orphan", 1)
    finally:
        other.close()


# ---------------------------------------------------------------------- log lines

def test_one_log_line_per_connection_open_and_close(broker, clients):
    c = clients(broker, container_id="log-line-check").wait_open()
    port = c.local_port
    opened = broker.wait_for_log(r"connection open: .*container=log-line-check")
    assert f"127.0.0.1:{port}" in opened and "user=anonymous" in opened
    c.close()
    closed = broker.wait_for_log(r"connection closed: .*container=log-line-check")
    assert f"127.0.0.1:{port}" in closed and "closed by peer" in closed
    text = broker.log_text()
    assert len(re.findall(r"connection open: .*container=log-line-check\b", text)) == 1
    assert len(re.findall(r"connection closed: .*container=log-line-check\b", text)) == 1
