"""End-to-end: `amqpbroker send` and `amqpbroker receive` against the real broker (the
README's quick start uses them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amqpbroker.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_send_then_receive_prints_the_bodies_in_order(broker_factory):
    b = broker_factory()
    sent = cli("send", "--url", b.url, "orders", "first order", "second order")
    assert sent.returncode == 0 and "sent 2 message(s) to orders" in sent.stderr, sent.stderr
    piped = cli("send", "--url", b.url, "orders", stdin="third\nfourth\n")
    assert piped.returncode == 0, piped.stderr
    got = cli("receive", "--url", b.url, "orders", "--count", "4")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == ["first order", "second order", "third", "fourth"]
    empty = cli("receive", "--url", b.url, "orders", "--count", "1", "--wait", "0.5")
    assert empty.returncode == 1 and empty.stdout == "", "nothing left: accepted, not redelivered"


def test_a_refused_send_exits_1_with_the_broker_condition(broker_factory):
    b = broker_factory('[users.app]\npassword = "app-pw"\n[[acl]]\nuser = "app"\npattern = "public.#"\n'
                       'permissions = ["send"]\n[anonymous]\npermissions = []\n')
    refused = cli("send", "--url", b.url, "--user", "app", "--password", "app-pw", "private", "x")
    assert refused.returncode == 1 and "amqp:unauthorized-access" in refused.stderr, refused.stderr
    ok = cli("send", "--url", b.url, "--user", "app", "--password", "app-pw", "public.news", "x")
    assert ok.returncode == 0, ok.stderr


def test_an_unreachable_broker_exits_3(broker_factory):
    b = broker_factory()
    url = b.url
    b.stop()
    done = cli("receive", "--url", url, "orders", "--wait", "0.5")
    assert done.returncode == 3 and "cannot connect" in done.stderr
