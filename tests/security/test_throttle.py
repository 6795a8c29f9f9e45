"""Authentication throttling decisions, with a fake clock."""

from __future__ import annotations

import pytest

from amqpbroker.security.throttle import AuthThrottle, source_address


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def throttle(**kw) -> tuple[AuthThrottle, Clock]:
    clock = Clock()
    return AuthThrottle(clock=clock, **kw), clock


def test_the_first_failures_are_free_then_the_delay_doubles_up_to_a_ceiling():
    t, _ = throttle(free_failures=3, base_delay=0.5, max_delay=4.0)
    delays = []
    for _ in range(9):
        delays.append(t.delay("10.0.0.1"))
        t.failed("10.0.0.1")
    assert delays == [0, 0, 0, 0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert t.failures_total == 9 and t.throttled_total == 5


def test_other_addresses_are_never_slowed():
    t, _ = throttle(free_failures=0)
    for _ in range(20):
        t.failed("10.0.0.1")
    assert t.delay("10.0.0.1") > 0
    assert t.delay("10.0.0.2") == 0


def test_a_success_forgives_the_failures_of_its_own_name():
    t, _ = throttle(free_failures=0)
    t.failed("a", "alice")
    t.failed("a", "alice")
    t.succeeded("a", "alice")             # typos, then the right password
    assert t.delay("a") == 0 and t.failures("a") == 0


def test_a_success_does_not_clear_guesses_at_other_names():
    """One good login between guesses used to clear the address: 78 guesses/s."""
    t, _ = throttle(free_failures=2, base_delay=0.5, max_delay=4.0)
    delays = []
    for _ in range(6):
        t.succeeded("a", "mallory")        # the guesser's own account, between guesses
        delays.append(t.delay("a", "alice"))
        t.failed("a", "alice")
    assert delays == [0, 0, 0, 0.5, 1.0, 2.0]
    t.succeeded("a", "mallory")
    assert t.failures("a") == 6
    t.succeeded("a", None)                 # a login that names no one forgives nothing
    assert t.failures("a") == 6


def test_guesses_at_one_name_from_many_addresses_slow_that_name():
    t, _ = throttle(free_failures=2, free_failures_per_user=3, base_delay=0.5, max_delay=4.0)
    delays = [t.delay("10.0.0.%d" % i, "alice") for i in range(1)]
    for i in range(6):
        delays.append(t.delay(f"10.0.1.{i}", "alice"))
        t.failed(f"10.0.1.{i}", "alice")
    assert delays == [0, 0, 0, 0, 0, 0.5, 1.0]
    assert t.user_delay("bob") == 0 and t.address_delay("10.0.9.9") == 0
    t.succeeded("10.0.9.9", "alice")       # the real alice logs in: her name's record goes
    assert t.user_delay("alice") == 0


def test_turns_space_the_attempts_and_refuse_beyond_the_queue():
    from amqpbroker.security.throttle import Turns
    clock = Clock()
    turns = Turns(clock, max_waiting=3)
    assert turns.take("a", 0) == 0
    assert [turns.take("a", 2.0) for _ in range(4)] == [2.0, 4.0, 6.0, None]
    assert turns.take("b", 2.0) == 2.0    # another key has its own turns
    clock.t += 10
    assert turns.take("a", 2.0) == 2.0


def test_an_address_that_stops_failing_is_forgotten():
    t, clock = throttle(free_failures=0, forget_after=60)
    t.failed("a")
    t.failed("a")
    clock.t += 61
    assert t.delay("a") == 0
    assert t.failed("a") == 1          # counting starts afresh


def test_memory_stays_bounded_under_a_flood_of_addresses():
    t, clock = throttle(max_addresses=100)
    for i in range(1000):
        clock.t += 0.001
        t.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(t._addresses.records) <= 100
    assert t.failures("10.0.3.231") == 1       # the latest is kept


@pytest.mark.parametrize("peer, address", [
    ("127.0.0.1:5672", "127.0.0.1"), ("[::1]:40000", "::1"), ("::1:40000", "::1"), ("unix", "unix"),
])
def test_source_address(peer, address):
    assert source_address(peer) == address


def test_ipv6_addresses_of_one_network_count_as_one():
    """Whoever has an IPv6 network has 2^64 addresses of it (a /64 is what a host or a
    home is given): counted one by one, each address had its own free failures and
    the per-address slowing never came.  IPv6 addresses are counted by their /64;
    IPv4 ones (IPv4-mapped IPv6 too) by the address."""
    t, _ = throttle(free_failures=3, base_delay=0.5, max_delay=4.0)
    for i in range(1, 6):
        t.failed(f"2001:db8:1:2::{i:x}", "alice")
    assert t.address_delay("2001:db8:1:2:ffff::1") > 0            # the same /64
    assert t.address_delay("2001:db8:1:3::1") == 0                # another network
    assert t.failures("2001:db8:1:2::99") == 5
    t.succeeded("2001:db8:1:2::7", "alice")                       # its own name, from the network
    assert t.failures("2001:db8:1:2::1") == 0
    for i in range(1, 6):
        t.failed(f"10.0.0.{i}", "bob")
    assert t.address_delay("10.0.0.9") == 0 and t.address_delay("10.0.0.1") == 0   # IPv4: each address
    for _ in range(5):
        t.failed("::ffff:10.0.0.20", "bob")
    assert t.address_delay("10.0.0.20") > 0 and t.failures("::ffff:10.0.0.21") == 0
    assert t.address_delay("not-an-address") == 0                 # anything else: as it is
