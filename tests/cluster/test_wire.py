"""The inter-node handshake (cluster/wire.py): only a node that knows the cluster's
secret gets to speak AMQP, and the user it names arrives intact."""

from __future__ import annotations

import pytest

from amqpbroker.cluster import wire

SECRET = b"s" * 32


def exchange(edge_secret: bytes, owner_secret: bytes, user):
    owner_nonce = wire.new_nonce()
    hello, expected = wire.edge_hello(edge_secret, owner_nonce, user)
    return owner_nonce, hello, expected


def test_a_node_with_the_secret_is_let_in_with_its_user():
    owner_nonce, hello, expected = exchange(SECRET, SECRET, "alice")
    used, user, epoch, proof = wire.read_edge_hello(SECRET, owner_nonce, hello + b"AMQP")
    assert (used, user, epoch) == (len(hello), "alice", 0)
    assert wire.check_owner_proof(expected, proof) is True


def test_no_user_is_not_the_empty_user():
    owner_nonce, hello, _ = exchange(SECRET, SECRET, None)
    assert wire.read_edge_hello(SECRET, owner_nonce, hello)[1] is None
    owner_nonce, hello, _ = exchange(SECRET, SECRET, "")
    assert wire.read_edge_hello(SECRET, owner_nonce, hello)[1] == ""


def test_a_wrong_secret_is_refused():
    owner_nonce, hello, _ = exchange(b"x" * 32, SECRET, "alice")
    with pytest.raises(wire.HandshakeFailed):
        wire.read_edge_hello(SECRET, owner_nonce, hello)


def test_a_replayed_hello_does_not_pass_another_nonce():
    owner_nonce, hello, _ = exchange(SECRET, SECRET, "alice")
    with pytest.raises(wire.HandshakeFailed):
        wire.read_edge_hello(SECRET, wire.new_nonce(), hello)


def test_a_changed_user_is_refused():
    owner_nonce, hello, _ = exchange(SECRET, SECRET, "alice")
    forged = hello.replace(b"alice", b"admin")
    with pytest.raises(wire.HandshakeFailed):
        wire.read_edge_hello(SECRET, owner_nonce, forged)


def test_an_owner_without_the_secret_is_not_believed():
    _, _, expected = exchange(SECRET, SECRET, "alice")
    with pytest.raises(wire.HandshakeFailed):
        wire.check_owner_proof(expected, b"z" * wire.PROOF)


def test_incomplete_bytes_wait():
    owner_nonce, hello, expected = exchange(SECRET, SECRET, "alice")
    for cut in (0, 5, wire.NONCE + 1, len(hello) - 1):
        assert wire.read_edge_hello(SECRET, owner_nonce, hello[:cut]) is None
    assert wire.check_owner_proof(expected, expected[:10]) is None


def test_a_user_name_longer_than_the_limit_is_refused_before_reading_it():
    owner_nonce = wire.new_nonce()
    head = wire.new_nonce() + (wire.MAX_USER + 1).to_bytes(2, "big")
    with pytest.raises(wire.HandshakeFailed):
        wire.read_edge_hello(SECRET, owner_nonce, head)


def test_the_map_id_arrives_and_cannot_be_changed_on_the_way():
    owner_nonce = wire.new_nonce()
    hello, _ = wire.edge_hello(SECRET, owner_nonce, "bob", map_id=7)
    assert wire.read_edge_hello(SECRET, owner_nonce, hello)[2] == 7
    forged = hello[:-wire.PROOF - 1] + bytes([8]) + hello[-wire.PROOF:]
    with pytest.raises(wire.HandshakeFailed):
        wire.read_edge_hello(SECRET, owner_nonce, forged)


def test_the_map_id_differs_exactly_when_nodes_would_place_differently():
    """Epoch, owners, pinned exchanges and partitioned destinations are in it (a node
    configured with other [cluster] options is refused at the handshake); which nodes
    are live is not (every node sees them at its own moment)."""
    from amqpbroker.core.placement import SlotMap, map_id, static_map
    base = static_map(["n0", "n1"], partitioned={"orders": 2}, pinned=frozenset({"events"}))
    same = static_map(["n0", "n1"], partitioned={"orders": 2}, pinned=frozenset({"events"}))
    assert map_id(base) == map_id(same) == map_id(base.with_live({"n0"}))
    others = [static_map(["n0", "n1"], partitioned={"orders": 3}, pinned=frozenset({"events"})),
              static_map(["n0", "n1"], partitioned={"orders": 2}),
              static_map(["n0", "n1"], {"n0": 1, "n1": 2}, partitioned={"orders": 2}, pinned=frozenset({"events"})),
              SlotMap(base.owners, base.live, 1, base.pinned, base.partitioned)]
    assert len({map_id(m) for m in others} | {map_id(base)}) == len(others) + 1
    assert all(0 <= map_id(m) < 1 << 64 for m in others)
