"""Broker-level rules without a socket: temporary destinations' consumers."""

from __future__ import annotations

from amqpbroker.core.broker import Broker
from tests.core.helpers import make_message


def test_temporary_queue_is_consumable_only_by_its_creator_but_open_to_senders():
    broker = Broker()
    creator, other = object(), object()
    broker.declare_temporary("amqpbroker.temp-queue.1", creator)
    assert broker.may_consume("amqpbroker.temp-queue.1", creator)
    assert not broker.may_consume("amqpbroker.temp-queue.1", other)
    # Sending (request/reply) needs no ownership: the queue is an ordinary target.
    target = broker.resolve("amqpbroker.temp-queue.1")
    assert [q.name for q in broker.publish(make_message("reply"), target)] == ["amqpbroker.temp-queue.1"]


def test_temporary_topic_is_a_fanout_exchange_consumable_only_by_its_creator():
    broker = Broker()
    creator, other = object(), object()
    broker.declare_temporary("amqpbroker.temp-topic.1", creator, topic=True)
    assert broker.exchanges["amqpbroker.temp-topic.1"].type.value == "fanout"
    assert broker.may_consume("amqpbroker.temp-topic.1", creator)
    assert not broker.may_consume("amqpbroker.temp-topic.1", other)


def test_ordinary_nodes_are_open_to_every_consumer():
    broker = Broker()
    broker.declare_queue("orders")
    assert broker.may_consume("orders", object()) and broker.may_consume("amq.topic", object())


def test_ownership_goes_with_the_node():
    broker = Broker()
    creator = object()
    broker.declare_temporary("amqpbroker.temp-queue.2", creator)
    broker.declare_temporary("amqpbroker.temp-topic.2", creator, topic=True)
    broker.delete_queue("amqpbroker.temp-queue.2")
    broker.delete_exchange("amqpbroker.temp-topic.2")
    assert broker.temporaries == {}
    # A node declared again under the name later is an ordinary one.
    broker.declare_queue("amqpbroker.temp-queue.2")
    assert broker.may_consume("amqpbroker.temp-queue.2", object())


# --------------------------------------------------------------------------- auto-created queues

from amqpbroker.core.addresses import AddressKind  # noqa: E402
from amqpbroker.core.broker import BrokerPolicy, QueueLimit  # noqa: E402
import pytest  # noqa: E402


def test_auto_created_queues_are_durable_whether_an_attach_or_a_message_names_them():
    broker = Broker()
    assert broker.auto_create("by-attach", "alice").durable
    target = broker.resolve("by-relay")
    assert target.kind is AddressKind.NEW_QUEUE
    broker.publish(make_message("m", durable=True), target, "alice")
    assert broker.queues["by-relay"].durable   # a durable message there survives a restart


def test_queues_per_user_are_limited_and_freed_by_deletion():
    broker = Broker(BrokerPolicy(max_queues_per_user=2))
    broker.auto_create("a1", "alice")
    broker.auto_create("a2", "alice")
    with pytest.raises(QueueLimit):
        broker.auto_create("a3", "alice")
    with pytest.raises(QueueLimit):
        broker.publish(make_message("m"), broker.resolve("a4"), "alice")
    assert broker.auto_create("b1", "bob").name == "b1"      # another user is not affected
    assert broker.auto_create("x1", None).creator == "anonymous"
    broker.delete_queue("a1")
    assert broker.auto_create("a3", "alice").name == "a3"
    assert broker.auto_create("a2", "alice").name == "a2"    # an existing queue is not counted again


def test_a_fan_out_without_filters_reaches_each_queue_once_and_follows_binding_changes():
    from amqpbroker.core.addresses import AddressKind, Resolution
    b = Broker()
    queues = [b.declare_queue(f"q{i}") for i in range(12)]
    for q in queues:
        b.bind("amq.topic", "k.#", q)
    b.bind("amq.topic", "#", queues[0])                      # bound twice: still once
    target = Resolution(AddressKind.EXCHANGE, "amq.topic", "k.x")
    assert b.publish(make_message("a"), target) == queues
    assert b.publish(make_message("b"), target) == queues    # (the kept result)
    late = b.declare_queue("late")
    b.bind("amq.topic", "k.x", late)
    assert b.publish(make_message("c"), target) == queues + [late]
    b.bind("amq.topic", "k.#", b.declare_queue("picky"), filter=lambda msg: False)
    assert b.publish(make_message("d"), target) == queues + [late]
    assert [q.depth for q in queues] == [4] * 12 and late.depth == 2
