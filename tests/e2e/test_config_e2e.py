"""End-to-end: what the broker process says about its configuration at start."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_an_environment_variable_that_sets_nothing_is_warned_about_at_start(broker_factory):
    b = broker_factory(env={"AMQPBROKER_MAX_CONECTIONS": "3", "AMQPBROKER_EXTRAS": "test"})
    b.wait_for_log(r"WARNING amqpbroker: environment variable AMQPBROKER_MAX_CONECTIONS is not a setting "
                   r"and is ignored \(did you mean AMQPBROKER_LIMITS__MAX_CONNECTIONS\?\)")
    assert "AMQPBROKER_EXTRAS" not in b.log_text(), "a tool's variable is not a mistake"


def test_management_on_the_network_without_a_manager_says_how_to_add_one(broker_factory):
    b = broker_factory(env={"AMQPBROKER_MANAGEMENT__HOST": "0.0.0.0"})
    b.wait_for_log(r"management API on 0\.0\.0\.0 answers loopback clients only: no access control "
                   r"\(\[\[acl\]\]\) is configured; to manage from elsewhere, add a user and an \[\[acl\]\] "
                   r"rule granting manage, e\.g\. AMQPBROKER_USERS__ADMIN__PASSWORD=")


def test_management_on_the_network_with_rules_but_no_manager_says_so(broker_factory):
    b = broker_factory('[users.app]\npassword = "app-pw"\n[[acl]]\nuser = "app"\npermissions = ["send"]\n',
                       env={"AMQPBROKER_MANAGEMENT__HOST": "0.0.0.0"})
    b.wait_for_log(r"management API on 0\.0\.0\.0: no user has the manage permission, every request is refused")


def test_management_on_the_network_with_a_manager_answers_it(broker_factory):
    import httpx

    from amqpbroker.security.users import hash_password
    b = broker_factory(env={"AMQPBROKER_MANAGEMENT__HOST": "0.0.0.0",
                            "AMQPBROKER_USERS__ADMIN__PASSWORD": hash_password("admin-pw"),
                            "AMQPBROKER_ACL": '[{"user": "admin", "permissions": ["manage"]}]'})
    url = f"http://127.0.0.1:{b.ports['management']}/api/overview"
    assert httpx.get(url, auth=("admin", "admin-pw"), timeout=10).json()["user"] == "admin"
    assert httpx.get(url, timeout=10).status_code == 401
    assert "answers loopback clients only" not in b.log_text() and "no user has the manage" not in b.log_text()
