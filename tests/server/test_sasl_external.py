"""SASL EXTERNAL (RFC 4422 Appendix A) in the sans-I/O handshake: the identity is
the one the TLS layer established (a verified client certificate's user)."""

from __future__ import annotations

import pytest

from amqpbroker.security.users import UserStore
from amqpbroker.server.sasl import Handshake, HandshakeState, SaslPolicy
from tests.server.test_sasl import AMQP, AUTH, OK, assert_failed, init, outcome_of, read_server, response, start_sasl

MECHS = ("EXTERNAL", "SCRAM-SHA-256", "PLAIN")


def make(external: str | None) -> Handshake:
    return Handshake(SaslPolicy(MECHS, False), UserStore({}, accounts=["app1"]), external=external)


def test_offered_first():
    assert start_sasl(make("app1")) == list(MECHS)


@pytest.mark.parametrize("initial", [b"", b"app1"], ids=["empty-authzid", "same-authzid"])
def test_certificate_identity_is_the_user(initial):
    hs = make("app1")
    start_sasl(hs)
    hs.feed(init("EXTERNAL", initial))
    assert outcome_of(read_server(hs)) == [OK]
    hs.feed(AMQP)
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("app1", "EXTERNAL")


def test_without_initial_response_gets_an_empty_challenge():
    hs = make("app1")
    start_sasl(hs)
    hs.feed(init("EXTERNAL"))
    assert read_server(hs)[0][0] == 0x42     # sasl-challenge
    hs.feed(response(b""))
    assert outcome_of(read_server(hs)) == [OK]
    assert hs.user == "app1"


def test_other_authorization_identity_refused():
    hs = make("app1")
    start_sasl(hs)
    hs.feed(init("EXTERNAL", b"root"))
    assert "authorization identity 'root' differs" in assert_failed(hs, AUTH)


def test_no_certificate_identity_refused():
    hs = make(None)
    start_sasl(hs)
    hs.feed(init("EXTERNAL", b""))
    assert "no verified client certificate" in assert_failed(hs, AUTH)


def test_not_offered_without_it():
    hs = Handshake(SaslPolicy(("PLAIN",), False), UserStore({}), external="app1")
    start_sasl(hs)
    hs.feed(init("EXTERNAL", b""))
    assert "not offered" in assert_failed(hs, AUTH)


def test_a_certificate_user_must_be_a_configured_user():
    hs = Handshake(SaslPolicy(MECHS, False), UserStore({"alice": "pw"}, accounts=["bob"]), external="app1")
    start_sasl(hs)
    hs.feed(init("EXTERNAL", b""))
    assert "not a configured user" in assert_failed(hs, AUTH)
    assert hs.attempted_user == "app1"


def test_the_user_store_in_force_at_login_decides():
    """A reload that removes the certificate's user after the socket was accepted:
    the handshake asks for the store when the client authenticates."""
    stores = {"now": UserStore({}, accounts=["app1"])}
    hs = Handshake(SaslPolicy(MECHS, False), lambda: stores["now"], external="app1")
    start_sasl(hs)
    stores["now"] = UserStore({}, accounts=["someone-else"])
    hs.feed(init("EXTERNAL", b""))
    assert "not a configured user" in assert_failed(hs, AUTH)


def test_why_a_certificate_names_no_one_is_said():
    from amqpbroker.security.certs import Identity
    hs = make(Identity(None, "CN=a,CN=b", "subject 'CN=a,CN=b' has 2 CNs: ambiguous"))
    start_sasl(hs)
    hs.feed(init("EXTERNAL", b""))
    assert "has 2 CNs: ambiguous" in assert_failed(hs, AUTH)
