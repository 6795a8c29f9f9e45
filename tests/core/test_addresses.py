import pytest

from amqpbroker.core.addresses import AddressKind, AddressNotFound, resolve, split_address


def _resolve(address, queues=(), exchanges=("amq.topic",), topic=False, auto=True):
    return resolve(address, queue_exists=set(queues).__contains__,
                   exchange_exists=set(exchanges).__contains__, topic=topic, auto_create=auto)


def test_split():
    assert split_address("ex/a.b") == ("ex", "a.b")
    assert split_address("/queue/x") == ("/queue/x", None)
    assert split_address("plain") == ("plain", None)


def test_exchange_with_key():
    r = _resolve("amq.topic/a.b")
    assert (r.kind, r.name, r.key) == (AddressKind.EXCHANGE, "amq.topic", "a.b")


def test_unknown_exchange_with_key_is_not_found():
    with pytest.raises(AddressNotFound, match="exchange 'nope' not found"):
        _resolve("nope/key")


def test_queue_wins_over_exchange_of_same_name():
    assert _resolve("x", queues=["x"], exchanges=["x"]).kind is AddressKind.QUEUE


def test_exchange_without_key():
    r = _resolve("amq.topic")
    assert r.kind is AddressKind.EXCHANGE and r.key is None


def test_topic_capability_maps_unknown_name_to_topic_exchange():
    r = _resolve("news", topic=True)
    assert (r.kind, r.name, r.key) == (AddressKind.EXCHANGE, "amq.topic", "news")


def test_auto_create_and_not_found():
    assert _resolve("newq").kind is AddressKind.NEW_QUEUE
    with pytest.raises(AddressNotFound):
        _resolve("newq", auto=False)


def test_control_and_gone_temporary_addresses_are_never_auto_created():
    with pytest.raises(AddressNotFound, match="control address"):
        _resolve("$amqpbroker.ack")
    with pytest.raises(AddressNotFound, match="no longer exists"):
        _resolve("amqpbroker.temp-queue.abc")
