import pytest

from amqpbroker.core.exchanges import Binding, Exchange, ExchangeType, topic_matches
from amqpbroker.core.queues import Queue


@pytest.mark.parametrize("pattern,key,match", [
    ("a.b", "a.b", True), ("a.b", "a.c", False),
    ("a.*", "a.b", True), ("a.*", "a", False), ("a.*", "a.b.c", False),
    ("a.#", "a", True), ("a.#", "a.b.c", True), ("#", "", True), ("#", "x.y", True),
    ("#.c", "a.b.c", True), ("#.c", "c", True), ("#.c", "a.b", False),
    ("a.#.d", "a.d", True), ("a.#.d", "a.b.c.d", True), ("a.#.d", "a.b.c", False),
    ("*.*", "a.b", True), ("*.*", "a", False), ("*", "", True),
])
def test_topic_matching(pattern, key, match):
    assert topic_matches(pattern, key) is match


def test_direct_routes_exact_key_and_cache_follows_bindings():
    ex = Exchange("d", ExchangeType.DIRECT)
    q1, q2 = Queue("q1"), Queue("q2")
    ex.bind(Binding("d", "k", q1))
    assert [b.queue for b in ex.route("k")] == [q1]
    ex.bind(Binding("d", "k", q2))
    assert [b.queue for b in ex.route("k")] == [q1, q2]
    ex.unbind_queue(q1)
    assert [b.queue for b in ex.route("k")] == [q2]
    assert ex.route("other") == ()


def test_fanout_ignores_key():
    ex = Exchange("f", ExchangeType.FANOUT)
    q = Queue("q")
    ex.bind(Binding("f", "anything", q))
    assert [b.queue for b in ex.route("zzz")] == [q]


def test_default_keys():
    assert Exchange("t", ExchangeType.TOPIC).default_key() == "#"
    assert Exchange("d", ExchangeType.DIRECT).default_key() == ""
