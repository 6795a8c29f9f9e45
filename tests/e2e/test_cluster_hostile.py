"""End to end: hostile or careless values on links and messages that a node forwards
to their owner (`serve --workers 3`, clients at n0, which owns nothing, without
hand-off).  The node in front decodes the attach, then encodes the same terms again
on its inter-node connection, so a value the owner must see whole passes through
two encoders.

How it could fail, and what is checked:
* a value nested as deep as the decoder allows breaks the second encoding, or the
  owner's decoding (it arrives one level deeper, inside the forwarded attach): the
  link is attached at the owner and delivers;
* a value nested deeper than that, or a frame over the advertised max-frame-size,
  takes a node down or hangs the client: the connection ends with the AMQP error
  condition that names it, and both nodes go on serving;
* deeply nested message annotations break the forwarded transfer (raw bytes at the
  node in front, decoded at the owner): Accepted, and received whole at the owner.
"""

from __future__ import annotations

import pytest
from proton import ConnectionException, Delivery, Message, symbol
from proton.reactor import LinkOption

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import fetch_body, receiver, send_bodies, sender
from tests.e2e.test_cluster import NO_HANDOFF, owned_by

pytestmark = pytest.mark.e2e

DEEPEST_ATTACHED = 60   # list depth inside the attach's properties that still decodes (core/codec.py MAX_DEPTH 64)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class Properties(LinkOption):
    """The attach's link properties (AMQP 1.0 §2.7.3: fields, any value)."""

    def __init__(self, properties: dict):
        self.properties = properties

    def apply(self, link) -> None:
        link.properties = self.properties


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("hostile") / "data", config=NO_HANDOFF).start()
    yield proc
    proc.stop()


def both_nodes_serve(cluster) -> None:
    """A fresh queue of n1, written and read through n0: the node in front and the owner work."""
    q = owned_by("n1")
    conn = connect(cluster.node_url("n0"))
    try:
        send_bodies(conn, q, ["after"])
        assert fetch_body(conn, receiver(conn, q)) == "after"
    finally:
        conn.close()
    assert "Traceback" not in cluster.log_text()


def test_properties_nested_as_deep_as_allowed_reach_the_owner_and_the_link_delivers(cluster):
    q = owned_by("n1")
    conn = connect(cluster.node_url("n0"))
    try:
        send_bodies(conn, q, ["deep"])
        rcv = receiver(conn, q, options=[Properties({symbol("x-deep"): nested(DEEPEST_ATTACHED)})])
        assert fetch_body(conn, rcv) == "deep"
    finally:
        conn.close()
    both_nodes_serve(cluster)


@pytest.mark.parametrize("properties, condition", [
    ({symbol("x-deep"): nested(DEEPEST_ATTACHED + 3)}, "amqp:decode-error"),
    # 70 KB of properties: over the 64 KiB max-frame-size the node advertised (§2.7.1).
    ({symbol(f"k{i}"): i for i in range(4500)}, "amqp:connection:framing-error"),
], ids=["nested-too-deep", "frame-too-large"])
def test_an_attach_the_node_cannot_take_ends_the_connection_with_its_condition_and_nothing_else(
        cluster, properties, condition):
    q = owned_by("n1")
    conn = connect(cluster.node_url("n0"))
    try:
        with pytest.raises(ConnectionException, match=condition):
            receiver(conn, q, options=[Properties(properties)])
    finally:
        try:
            conn.close()
        except ConnectionException:
            pass   # already closed by the node, as asserted
    both_nodes_serve(cluster)


def test_deeply_nested_message_annotations_cross_to_the_owner_whole(cluster):
    q = owned_by("n1")
    msg = Message(body="annotated", durable=True)
    msg.annotations = {symbol("x-deep"): nested(DEEPEST_ATTACHED)}
    conn = connect(cluster.node_url("n0"))
    try:
        assert sender(conn, q).send(msg, timeout=10).remote_state == Delivery.ACCEPTED
    finally:
        conn.close()
    conn = connect(cluster.node_url("n1"))
    try:
        rcv = receiver(conn, q)
        got = rcv.receive(timeout=10)
        rcv.accept()
    finally:
        conn.close()
    assert got.body == "annotated" and got.annotations[symbol("x-deep")] == nested(DEEPEST_ATTACHED)
    both_nodes_serve(cluster)
