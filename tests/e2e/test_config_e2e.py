"""End-to-end: what the broker process says about its configuration at start."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_an_environment_variable_that_sets_nothing_is_warned_about_at_start(broker_factory):
    b = broker_factory(env={"AMQPBROKER_MAX_CONECTIONS": "3", "AMQPBROKER_EXTRAS": "test"})
    b.wait_for_log(r"WARNING amqpbroker: environment variable AMQPBROKER_MAX_CONECTIONS is not a setting "
                   r"and is ignored \(did you mean AMQPBROKER_LIMITS__MAX_CONNECTIONS\?\)")
    assert "AMQPBROKER_EXTRAS" not in b.log_text(), "a tool's variable is not a mistake"
