"""Settings decisions that do not need a broker."""

from __future__ import annotations

import pytest

from amqpbroker.config import anonymous_allowed, plain_allowed


@pytest.mark.parametrize("setting, host, tls, allowed", [
    (None, "127.0.0.1", False, True),    # loopback: nobody else reads the socket
    (None, "::1", False, True),
    (None, "0.0.0.0", False, False),     # the network, in clear: not by default
    (None, "10.0.0.5", False, False),
    (None, "0.0.0.0", True, True),       # TLS protects the password
    (True, "0.0.0.0", False, True),      # the operator's explicit choice
    (False, "127.0.0.1", False, False),
    (False, "0.0.0.0", True, True),      # never turned off where TLS protects it
])
def test_plain_allowed(setting, host, tls, allowed):
    assert plain_allowed(setting, host, tls) is allowed


@pytest.mark.parametrize("setting, host, allowed", [
    (None, "127.0.0.1", True), (None, "0.0.0.0", False), (True, "0.0.0.0", True), (False, "127.0.0.1", False),
])
def test_anonymous_allowed(setting, host, allowed):
    assert anonymous_allowed(setting, host) is allowed
