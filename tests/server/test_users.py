"""Tests of amqpbroker.security.users: SCRAM-SHA-256 verifiers and the user store."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from amqpbroker.security import users as users_mod
from amqpbroker.security.users import (
    ScramCredentials,
    UserStore,
    hash_password,
    parse_password_hash,
    saslprep,
)

# RFC 7677 §3 example exchange
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_FIRST_BARE = "n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_FIRST = "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC_CLIENT_FINAL_NO_PROOF = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_PROOF = "dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
RFC_SERVER_SIGNATURE = "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def test_hash_format_is_self_describing_and_round_trips():
    h = hash_password("pencil", iterations=4096, salt=RFC_SALT)
    prefix, iters, salt, stored, server = h.split("$")
    assert prefix == "scram-sha-256"
    assert iters == "4096"
    assert salt == "W22ZaJ0SNY7soEsUEjb6gQ=="
    assert "pencil" not in h
    creds = parse_password_hash(h)
    assert creds == ScramCredentials(4096, RFC_SALT, base64.b64decode(stored), base64.b64decode(server))
    assert len(creds.stored_key) == len(creds.server_key) == 32


def test_random_salt_differs_between_hashes():
    a, b = hash_password("x", iterations=2), hash_password("x", iterations=2)
    assert a != b
    assert parse_password_hash(a).salt != parse_password_hash(b).salt


def test_rfc7677_key_derivation_matches_the_rfc_exchange():
    """StoredKey/ServerKey derived from "pencil" verify the RFC's ClientProof and
    reproduce its ServerSignature (RFC 7677 §3, RFC 5802 §3)."""
    creds = parse_password_hash(hash_password("pencil", iterations=4096, salt=RFC_SALT))
    auth_message = ",".join((RFC_CLIENT_FIRST_BARE, RFC_SERVER_FIRST, RFC_CLIENT_FINAL_NO_PROOF)).encode()
    client_signature = hmac.digest(creds.stored_key, auth_message, "sha256")
    client_key = bytes(a ^ b for a, b in zip(base64.b64decode(RFC_PROOF), client_signature))
    assert hashlib.sha256(client_key).digest() == creds.stored_key
    server_signature = hmac.digest(creds.server_key, auth_message, "sha256")
    assert base64.b64encode(server_signature).decode() == RFC_SERVER_SIGNATURE


@pytest.mark.parametrize(
    "bad, message",
    [
        ("pbkdf2$4096$a$b$c", "must start with"),
        ("scram-sha-256$4096$abc", "must have the form"),
        ("scram-sha-256$abc$AAAA$AAAA$AAAA", "not a positive integer"),
        ("scram-sha-256$0$AAAA$AAAA$AAAA", "out of range"),
        ("scram-sha-256$4096$!!!$AAAA$AAAA", "salt is not valid base64"),
        ("scram-sha-256$4096$$AAAA$AAAA", "salt is empty"),
        ("scram-sha-256$4096$AAAA$AAAA$AAAA", "StoredKey must be 32 bytes"),
    ],
)
def test_parse_password_hash_rejects_bad_hashes(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_password_hash(bad)


def test_hash_password_validates_iterations():
    with pytest.raises(ValueError):
        hash_password("x", iterations=0)


def test_store_verifies_hashed_and_plaintext_entries():
    store = UserStore({"bob": hash_password("secret", iterations=16), "alice": "wonderland"})
    assert store.verify_plain("bob", "secret")
    assert not store.verify_plain("bob", "Secret")
    assert store.verify_plain("alice", "wonderland")
    assert not store.verify_plain("alice", "")
    assert not store.verify_plain("carol", "secret")
    assert "bob" in store and "alice" in store and "carol" not in store
    assert len(store) == 2


def test_plaintext_is_hashed_at_load():
    store = UserStore({"alice": "wonderland"})
    creds = store.scram_credentials("alice")
    assert isinstance(creds, ScramCredentials)
    assert creds.iterations == 4096
    assert "wonderland" not in repr(creds) and "wonderland" not in repr(store)
    assert creds == users_mod.derive_scram_credentials("wonderland", creds.salt, 4096)


def test_scram_credentials_of_unknown_user_is_none():
    assert UserStore({"bob": "x"}).scram_credentials("nobody") is None


def test_bad_hash_in_store_names_the_user():
    with pytest.raises(ValueError, match="user 'bob'.*StoredKey"):
        UserStore({"bob": "scram-sha-256$4096$AAAA$AAAA$AAAA"})


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_bad_user_names_are_rejected(name):
    with pytest.raises(ValueError):
        UserStore({name: "pw"})


def test_unknown_user_costs_the_same_pbkdf2_work(monkeypatch):
    store = UserStore({"bob": hash_password("secret", iterations=777),
                       "eve": hash_password("x", iterations=777),
                       "old": hash_password("y", iterations=5)})
    calls = []
    real = hashlib.pbkdf2_hmac

    def spy(name, password, salt, iterations):
        calls.append(iterations)
        return real(name, password, salt, iterations)

    monkeypatch.setattr(users_mod.hashlib, "pbkdf2_hmac", spy)
    assert not store.verify_plain("nobody", "secret")
    assert not store.verify_plain("bob", "wrong")
    assert calls == [777, 777]


def test_unknown_user_never_verifies_even_against_a_matching_dummy(monkeypatch):
    store = UserStore({"bob": "pw"})
    monkeypatch.setattr(store, "_dummy", users_mod.derive_scram_credentials("guess", b"salt", 4096))
    assert not store.verify_plain("nobody", "guess")


def test_decoy_credentials_are_stable_per_user_and_never_verify():
    store = UserStore({"bob": "pw"})
    a1, a2, b = (store.decoy_scram_credentials(u) for u in ("ghost", "ghost", "spook"))
    assert a1 == a2
    assert a1.salt != b.salt
    assert a1.iterations == 4096
    assert UserStore({"bob": "pw"}).decoy_scram_credentials("ghost").salt != a1.salt


@pytest.mark.parametrize(
    "raw, prepped",
    [  # RFC 4013 §3 examples
        ("I\u00adX", "IX"),
        ("user", "user"),
        ("USER", "USER"),
        ("\u00aa", "a"),
        ("\u2168", "IX"),
        ("a\u00a0b", "a b"),
    ],
)
def test_saslprep_examples(raw, prepped):
    assert saslprep(raw) == prepped


@pytest.mark.parametrize("raw", ["\u0007", "\u0627\u0031"])
def test_saslprep_rejects_prohibited_and_bad_bidi(raw):
    with pytest.raises(ValueError):
        saslprep(raw)


def test_passwords_are_saslprepped_consistently():
    store = UserStore({"bob": "I\u00adX"})
    assert store.verify_plain("bob", "IX")
    assert store.verify_plain("bob", "\u2168")
    # strings SASLprep refuses are used verbatim instead of being unusable
    emoji = UserStore({"bob": "pw\U0001F600"})
    assert emoji.verify_plain("bob", "pw\U0001F600")
    assert not emoji.verify_plain("bob", "pw")
