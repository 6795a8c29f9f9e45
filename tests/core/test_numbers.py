"""core/numbers.py `ascii_int`, and each place that reads a number from text the
broker did not write this run: `str.isdigit` is true for `²`, which `int` refuses,
so each of these raised ValueError (a crash at start, a refused login, a 500) where
"not a number" was meant."""

from __future__ import annotations

import pytest

from amqpbroker.core.numbers import ascii_int


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("42", 42), ("007", 7), ("18446744073709551616", 1 << 64),
    ("", None), ("²", None), ("1²", None), ("٣", None), ("-1", None), ("+1", None), (" 1", None),
    ("1 ", None), ("1_000", None), ("1.0", None), ("max", None),
])
def test_only_ascii_digits_are_a_number(text, value):
    assert ascii_int(text) == value


def test_a_data_dir_entry_that_only_looks_like_a_worker_store_is_not_one(tmp_path):
    from amqpbroker.store.integrity import DATA_FILE
    from amqpbroker.store.layout import worker_stores
    for name in ("node-1", "node-²", "node-x"):
        (tmp_path / name / "store").mkdir(parents=True)
        (tmp_path / name / "store" / DATA_FILE).write_bytes(b"")
    assert worker_stores(tmp_path) == [1]


@pytest.mark.parametrize("text, pid", [("1234\n", 1234), ("²\n", None), ("", None), ("x 1", None)])
def test_a_lock_file_names_a_pid_or_none(tmp_path, text, pid):
    from amqpbroker.store.lock import holder_pid
    lock = tmp_path / "lock"
    lock.write_text(text)
    assert holder_pid(lock) == pid


@pytest.mark.parametrize("text, limit", [("max\n", None), ("1048576\n", 1 << 20), ("²\n", None)])
def test_a_cgroup_limit_is_a_number_or_no_limit(text, limit):
    from amqpbroker.core.alarms import parse_limit
    assert parse_limit(text) == limit


@pytest.mark.parametrize("value, split", [
    ("example.com:8080", ("example.com", 8080)), ("example.com:²", None), ("[::1]:²", None),
    ("example.com:65536", None), ("example.com:000080", None),
])
def test_a_host_header_port_is_ascii_digits(value, split):
    from amqpbroker.management.request_policy import split_host
    assert split_host(value) == split


def test_a_password_hash_with_a_non_ascii_iteration_count_is_refused_as_malformed():
    from amqpbroker.security.users import parse_password_hash
    with pytest.raises(ValueError, match="iteration count '²' is not a positive integer"):
        parse_password_hash("scram-sha-256$²$AAAA$AAAA$AAAA")


@pytest.mark.parametrize("peer, address", [("10.0.0.1:5672", "10.0.0.1"), ("[::1]:5672", "::1"),
                                           ("host:²", "host:²")])
def test_a_peer_address_without_an_ascii_port_is_counted_whole(peer, address):
    from amqpbroker.security.throttle import source_address
    assert source_address(peer) == address
