import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _best_of(fn, runs: int = 5) -> float:
    import time
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_topic_matching_costs_pattern_x_key_not_an_exponential():
    """A client's binding key with many '#' (`amq.topic/#.#.#.#.#.#.#.#.#.#.z`) against
    a message subject of many words: the recursive matcher tried every way to split
    the words among the '#'s: 10 '#' against 20 words took 35 s, 12 against 24 half an
    hour, all on the broker's one loop.  Compared with a short pattern in the same run."""
    key = ".".join(["a"] * 14)
    uncached = topic_matches.__wrapped__          # (answers are cached per pattern and key)
    short = _best_of(lambda: uncached("#.z", key))
    hashes = _best_of(lambda: uncached(".".join(["#"] * 7 + ["z"]), key), runs=3)
    assert hashes < 100 * short + 0.001, f"{hashes * 1000:.1f} ms against {short * 1000:.3f} ms"
    assert topic_matches(".".join(["#"] * 40 + ["z"]), ".".join(["a"] * 200)) is False
    assert topic_matches(".".join(["#"] * 40 + ["z"]), ".".join(["a"] * 200 + ["z"])) is True


@settings(max_examples=800, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=7),
       st.lists(st.sampled_from(["a", "b", ""]), min_size=1, max_size=7))
def test_topic_matching_means_what_it_says(pattern_words, key_words):
    """`*` one word, `#` zero or more: the same answers as the definition."""
    pattern, key = ".".join(pattern_words), ".".join(key_words)
    assert topic_matches(pattern, key) is _reference(tuple(pattern_words), tuple(key_words))


def _reference(pattern: tuple, words: tuple) -> bool:
    """The definition, by plain recursion (small inputs only)."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_reference(rest, words[i:]) for i in range(len(words) + 1))
    return bool(words) and head in ("*", words[0]) and _reference(rest, words[1:])
