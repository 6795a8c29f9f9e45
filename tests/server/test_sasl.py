"""Tests of the sans-I/O AMQP 1.0 header/SASL server (amqpbroker.server.sasl).

The client side is built here with proton.Data (independently of
amqpbroker.server.sasl_frames) and, at the end, with proton's real client
Transport (Cyrus SASL).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Connection, Data, Described, Endpoint, Transport, symbol

from amqpbroker.security.users import UserStore, derive_scram_credentials, hash_password
from amqpbroker.server import sasl as sasl_mod
from amqpbroker.server.sasl import Handshake, HandshakeState, SaslPolicy

AMQP = b"AMQP\x00\x01\x00\x00"
SASL = b"AMQP\x03\x01\x00\x00"
TLS = b"AMQP\x02\x01\x00\x00"
# Bytes a client sends after the AMQP header: an open frame (container-id "abc").
OPEN_FRAME = b"\x00\x00\x00\x13\x02\x00\x00\x00\x00\x53\x10\xc0\x06\x01\xa1\x03abc"

ALL = ("SCRAM-SHA-256", "PLAIN", "ANONYMOUS")
OK, AUTH, SYS, SYS_PERM, SYS_TEMP = range(5)


# --------------------------------------------------------------------------
# a tiny client-side codec
# --------------------------------------------------------------------------


def frame(code, *fields, symbolic=False):
    """Encode a SASL frame whose body is a described list of ``fields``."""
    d = Data()
    d.put_described()
    d.enter()
    if symbolic:
        d.put_symbol(symbol(symbolic))
    else:
        d.put_ulong(code)
    d.put_list()
    d.enter()
    for f in fields:
        if f is None:
            d.put_null()
        elif isinstance(f, symbol):
            d.put_symbol(f)
        elif isinstance(f, bytes):
            d.put_binary(f)
        elif isinstance(f, str):
            d.put_string(f)
        else:
            raise TypeError(f)
    d.exit()
    d.exit()
    body = bytes(d.encode())
    return struct.pack(">IBBH", 8 + len(body), 2, 1, 0) + body


def init(mech, initial=None, hostname=None, **kw):
    fields = [symbol(mech), initial] + ([hostname] if hostname is not None else [])
    return frame(0x41, *fields, **kw)


def response(data):
    return frame(0x43, data)


def parse_frames(data):
    """Split server output into a list of (descriptor, fields)."""
    out = []
    while data:
        size, doff, ftype, _ = struct.unpack_from(">IBBH", data)
        assert ftype == 1 and doff == 2
        d = Data()
        d.decode(data[doff * 4:size])
        d.rewind()
        d.next()
        obj = d.get_object()
        assert isinstance(obj, Described)
        fields = [bytes(f) if isinstance(f, memoryview) else f for f in obj.value]
        out.append((int(obj.descriptor), fields))
        data = data[size:]
    return out


def read_server(hs, expect_header=False):
    data = hs.data_to_send()
    if expect_header:
        assert data[:8] == SASL
        data = data[8:]
    return parse_frames(data)


def outcome_of(frames):
    assert frames[-1][0] == 0x44
    return frames[-1][1]


@pytest.fixture
def store():
    return UserStore({"bob": hash_password("secret", iterations=64), "alice": "wonderland",
                      "a,b=c": "tricky"})


def make(store, mechanisms=ALL, allow_no_sasl=False, **kw):
    return Handshake(SaslPolicy(mechanisms, allow_no_sasl, **kw), store)


def start_sasl(hs):
    hs.feed(SASL)
    frames = read_server(hs, expect_header=True)
    assert frames[0][0] == 0x40
    return [str(m) for m in frames[0][1][0]]


def assert_failed(hs, code=AUTH):
    frames = read_server(hs)
    assert outcome_of(frames)[0] == code
    assert hs.state is HandshakeState.FAILED
    assert hs.close_after_send
    assert hs.user is None
    return hs.error


# --------------------------------------------------------------------------
# SCRAM-SHA-256 client (RFC 5802 §3) computed with hashlib/hmac
# --------------------------------------------------------------------------


class ScramClient:
    def __init__(self, user, password, nonce="fyko+d2lbbFgONRv9qkxdawL", gs2="n,,"):
        self.password, self.nonce, self.gs2 = password, nonce, gs2
        escaped = user.replace("=", "=3D").replace(",", "=2C")
        self.first_bare = f"n={escaped},r={nonce}"

    def first(self):
        return (self.gs2 + self.first_bare).encode()

    def final(self, server_first: bytes, cbind=None, nonce=None, tamper=False):
        self.server_first = server_first.decode()
        attrs = dict(a.split("=", 1) for a in self.server_first.split(","))
        assert attrs["r"].startswith(self.nonce) and len(attrs["r"]) > len(self.nonce)
        salted = hashlib.pbkdf2_hmac("sha256", self.password.encode(), base64.b64decode(attrs["s"]),
                                     int(attrs["i"]))
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        stored_key = hashlib.sha256(client_key).digest()
        cb = cbind if cbind is not None else base64.b64encode(self.gs2.encode()).decode()
        without_proof = f"c={cb},r={nonce if nonce is not None else attrs['r']}"
        auth = ",".join((self.first_bare, self.server_first, without_proof)).encode()
        proof = bytes(a ^ b for a, b in zip(client_key, hmac.digest(stored_key, auth, "sha256")))
        if tamper:
            proof = bytes([proof[0] ^ 1]) + proof[1:]
        server_key = hmac.digest(salted, b"Server Key", "sha256")
        self.expected_v = b"v=" + base64.b64encode(hmac.digest(server_key, auth, "sha256"))
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()


def scram_challenge(hs, client):
    hs.feed(init("SCRAM-SHA-256", client.first()))
    frames = read_server(hs)
    assert [f[0] for f in frames] == [0x42]
    return frames[0][1][0]


# --------------------------------------------------------------------------
# policy and header negotiation
# --------------------------------------------------------------------------


def test_mechanisms_offered_in_preference_order(store):
    hs = make(store, mechanisms=("ANONYMOUS", "PLAIN", "SCRAM-SHA-256"))
    assert start_sasl(hs) == ["SCRAM-SHA-256", "PLAIN", "ANONYMOUS"]
    assert hs.state is HandshakeState.SASL
    assert make(store, mechanisms=("PLAIN",)).policy.offered == ("PLAIN",)
    hs = make(store, mechanisms=("ANONYMOUS", "PLAIN"))
    assert start_sasl(hs) == ["PLAIN", "ANONYMOUS"]


def test_policy_validation():
    with pytest.raises(ValueError, match="unsupported"):
        SaslPolicy(("CRAM-MD5",), False)
    with pytest.raises(ValueError, match="no client"):
        SaslPolicy((), False)


def test_plain_amqp_header_allowed_without_sasl(store):
    hs = make(store, allow_no_sasl=True, anonymous_user="guest")
    hs.feed(AMQP + OPEN_FRAME)
    assert hs.state is HandshakeState.DONE
    assert hs.user == "guest" and hs.mechanism is None
    assert hs.leftover == AMQP + OPEN_FRAME
    assert hs.data_to_send() == b""
    assert not hs.close_after_send


def test_plain_amqp_header_refused_when_sasl_required(store):
    hs = make(store)
    hs.feed(AMQP + OPEN_FRAME)
    assert hs.data_to_send() == SASL
    assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert "authentication is required" in hs.error
    assert hs.leftover == b""


def test_tls_header_refused(store):
    hs = make(store)
    hs.feed(TLS)
    assert hs.data_to_send() == SASL
    assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert "TLS" in hs.error


def test_no_mechanisms_replies_with_amqp_header_to_sasl(store):
    hs = make(store, mechanisms=(), allow_no_sasl=True)
    hs.feed(SASL)
    assert hs.data_to_send() == AMQP
    assert hs.state is HandshakeState.FAILED


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01"])
def test_garbage_header_fails_at_once(store, garbage):
    hs = make(store)
    hs.feed(garbage[:1])  # detected from the first byte, no need to wait for 8
    assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert hs.data_to_send() == SASL
    assert "garbage" in hs.error
    hs.feed(garbage[1:])  # ignored after failure, never raises
    assert hs.data_to_send() == b""


def test_unsupported_amqp_version_refused(store):
    hs = make(store)
    hs.feed(b"AMQP\x00\x00\x09\x01")  # AMQP 0-9-1
    assert hs.data_to_send() == SASL
    assert hs.state is HandshakeState.FAILED
    assert "unsupported AMQP protocol header" in hs.error


def test_incomplete_header_waits(store):
    hs = make(store)
    hs.feed(SASL[:7])
    assert hs.state is HandshakeState.AWAITING_HEADER and hs.data_to_send() == b""


# --------------------------------------------------------------------------
# ANONYMOUS and PLAIN
# --------------------------------------------------------------------------


def test_anonymous(store):
    hs = make(store, anonymous_user="guest")
    start_sasl(hs)
    hs.feed(init("ANONYMOUS", b"trace@example", hostname="vhost1"))
    assert outcome_of(read_server(hs)) == [OK]
    assert hs.state is HandshakeState.AWAITING_AMQP_HEADER
    hs.feed(AMQP + OPEN_FRAME)
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism, hs.hostname) == ("guest", "ANONYMOUS", "vhost1")
    assert hs.leftover == AMQP + OPEN_FRAME


def test_anonymous_without_initial_response(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("ANONYMOUS"))
    assert outcome_of(read_server(hs)) == [OK]


def test_anonymous_not_offered_is_refused(store):
    hs = make(store, mechanisms=("PLAIN",))
    assert start_sasl(hs) == ["PLAIN"]
    hs.feed(init("ANONYMOUS", b""))
    assert "not offered" in assert_failed(hs, AUTH)


def test_unknown_mechanism_is_refused(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("GSSAPI", b"x"))
    assert "'GSSAPI'" in assert_failed(hs, AUTH)


def test_plain_good_password(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"\x00bob\x00secret"))
    assert outcome_of(read_server(hs)) == [OK]
    hs.feed(AMQP)
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("bob", "PLAIN")
    assert hs.leftover == AMQP
    assert hs.error is None and not hs.close_after_send


def test_plain_plaintext_configured_user(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", "\x00alice\x00wonderland".encode()))
    assert outcome_of(read_server(hs)) == [OK]
    assert hs.user == "alice"


def test_plain_bad_password(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"\x00bob\x00wrong"))
    err = assert_failed(hs, AUTH)
    assert err.startswith("authentication failed for user 'bob' (PLAIN)")
    assert "wrong" not in err  # never log the password


def test_plain_unknown_user_looks_identical_on_the_wire(store):
    wire = []
    for creds in (b"\x00bob\x00wrong", b"\x00nobody\x00wrong"):
        hs = make(store)
        start_sasl(hs)
        hs.feed(init("PLAIN", creds))
        wire.append(hs.data_to_send())
        assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert wire[0] == wire[1]
    assert parse_frames(wire[1]) == [(0x44, [AUTH])]
    assert "'nobody'" in hs.error


def test_plain_authzid_must_match(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"root\x00bob\x00secret"))
    assert "authorization identity 'root'" in assert_failed(hs, AUTH)
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"bob\x00bob\x00secret"))
    assert outcome_of(read_server(hs)) == [OK] and hs.user == "bob"


@pytest.mark.parametrize("msg", [b"bob:secret", b"\x00bob\x00secret\x00x", b"\x00\x00secret",
                                 b"\x00b\xffob\x00secret"])
def test_plain_malformed(store, msg):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", msg))
    assert "malformed PLAIN" in assert_failed(hs, AUTH)


def test_plain_without_initial_response_gets_empty_challenge(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN"))  # RFC 4422 §5: server sends an empty challenge
    assert read_server(hs) == [(0x42, [b""])]
    hs.feed(response(b"\x00bob\x00secret"))
    assert outcome_of(read_server(hs)) == [OK]
    assert hs.user == "bob"


def test_symbolic_descriptor_accepted(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"\x00bob\x00secret", symbolic="amqp:sasl-init:list"))
    assert outcome_of(read_server(hs)) == [OK]


# --------------------------------------------------------------------------
# SCRAM-SHA-256
# --------------------------------------------------------------------------


def test_scram_full_exchange(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    server_first = scram_challenge(hs, client)
    assert server_first.decode().endswith(",i=64")
    hs.feed(response(client.final(server_first)))
    # RFC 5802 §7 server-final-message travels in sasl-outcome additional-data
    assert outcome_of(read_server(hs)) == [OK, client.expected_v]
    hs.feed(AMQP + OPEN_FRAME)
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("bob", "SCRAM-SHA-256")
    assert hs.leftover == AMQP + OPEN_FRAME


def test_scram_with_escaped_user_name_and_matching_authzid(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("a,b=c", "tricky", gs2="n,a=a=2Cb=3Dc,")
    assert b"n=a=2Cb=3Dc" in client.first()
    hs.feed(init("SCRAM-SHA-256", client.first()))
    hs.feed(response(client.final(read_server(hs)[0][1][0])))
    assert outcome_of(read_server(hs))[0] == OK
    assert hs.user == "a,b=c"


def test_scram_y_flag_accepted(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "secret", gs2="y,,")
    final = client.final(scram_challenge(hs, client))
    assert final.startswith(b"c=eSws,")
    hs.feed(response(final))
    assert outcome_of(read_server(hs)) == [OK, client.expected_v]


def test_scram_wrong_proof(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "not-the-password")
    hs.feed(response(client.final(scram_challenge(hs, client))))
    assert assert_failed(hs, AUTH) == "authentication failed for user 'bob' (SCRAM-SHA-256): invalid proof"


def test_scram_tampered_proof(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    hs.feed(response(client.final(scram_challenge(hs, client), tamper=True)))
    assert "invalid proof" in assert_failed(hs, AUTH)


def test_scram_unknown_user_is_not_revealed():
    store = UserStore({"bob": hash_password("secret", iterations=64),
                       "eve": hash_password("x", iterations=64)})
    firsts = []
    for _ in range(2):
        hs = make(store)
        start_sasl(hs)
        client = ScramClient("ghost", "secret")
        server_first = scram_challenge(hs, client)  # a normal-looking challenge
        firsts.append(server_first)
        hs.feed(response(client.final(server_first)))
        assert parse_frames(hs.data_to_send()) == [(0x44, [AUTH])]
        assert hs.state is HandshakeState.FAILED
    salts = [dict(a.split("=", 1) for a in f.decode().split(","))["s"] for f in firsts]
    assert salts[0] == salts[1]  # stable, like a real user's salt
    assert firsts[0].decode().endswith(",i=64")  # the store's usual iteration count
    assert "'ghost'" in hs.error and "unknown user" in hs.error  # the log may say why


def test_scram_unknown_user_fails_even_if_the_decoy_matched(store, monkeypatch):
    # defence in depth: the decoy is never accepted, whatever its keys
    salt = b"0123456789abcdef"
    monkeypatch.setattr(store, "decoy_scram_credentials",
                        lambda user: derive_scram_credentials("secret", salt, 64))
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("ghost", "secret")
    hs.feed(response(client.final(scram_challenge(hs, client))))
    assert "unknown user" in assert_failed(hs, AUTH)


def test_scram_channel_binding_refused(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("SCRAM-SHA-256", b"p=tls-server-end-point,,n=bob,r=abc"))
    assert "channel binding" in assert_failed(hs, AUTH)


@pytest.mark.parametrize("first", [b"x,,n=bob,r=abc", b"n,,r=abc,n=bob", b"n,,n=bob,r=a,b",
                                   b"n,,n=b=2Xob,r=abc", b"n,,m=ext,n=bob,r=abc", b"n,,n=,r=abc",
                                   b"n,,n=bob,r=", b"n,", b"\xff", b"n,,n=bob,r=a\x01b"])
def test_scram_malformed_client_first(store, first):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("SCRAM-SHA-256", first))
    assert "SCRAM-SHA-256" in assert_failed(hs, AUTH)


def test_scram_authzid_mismatch(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("SCRAM-SHA-256", b"n,a=root,n=bob,r=abc"))
    assert "authorization identity 'root'" in assert_failed(hs, AUTH)


def test_scram_channel_binding_echo_checked(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    hs.feed(response(client.final(scram_challenge(hs, client), cbind="eSws")))  # "y,," not "n,,"
    assert "channel binding" in assert_failed(hs, AUTH)


def test_scram_nonce_checked(store):
    hs = make(store)
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    hs.feed(response(client.final(scram_challenge(hs, client), nonce=client.nonce + "forged")))
    assert "nonce" in assert_failed(hs, AUTH)


def test_scram_rfc7677_vector_through_the_handshake(monkeypatch):
    """The complete RFC 7677 §3 exchange, byte for byte."""
    monkeypatch.setattr(sasl_mod, "_server_nonce", lambda: "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0")
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    hs = make(UserStore({"user": hash_password("pencil", iterations=4096, salt=salt)}))
    start_sasl(hs)
    hs.feed(init("SCRAM-SHA-256", b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"))
    assert read_server(hs) == [(0x42, [b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                                       b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"])]
    hs.feed(response(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                     b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="))
    assert read_server(hs) == [(0x44, [OK, b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="])]
    assert hs.user == "user"


def test_scram_without_initial_response(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("SCRAM-SHA-256"))
    assert read_server(hs) == [(0x42, [b""])]
    client = ScramClient("bob", "secret")
    hs.feed(response(client.first()))
    server_first = read_server(hs)[0][1][0]
    hs.feed(response(client.final(server_first)))
    assert outcome_of(read_server(hs)) == [OK, client.expected_v]


# --------------------------------------------------------------------------
# framing, splitting, leftovers, robustness
# --------------------------------------------------------------------------


def plain_conversation():
    return SASL + init("PLAIN", b"\x00bob\x00secret") + AMQP + OPEN_FRAME


def test_everything_in_one_feed(store):
    hs = make(store)
    hs.feed(plain_conversation())
    out = hs.data_to_send()
    assert out.startswith(SASL)
    assert [f[0] for f in parse_frames(out[8:])] == [0x40, 0x44]
    assert hs.state is HandshakeState.DONE
    assert hs.leftover == AMQP + OPEN_FRAME


def test_split_feeding_byte_by_byte(store):
    hs = make(store)
    states = set()
    for b in plain_conversation():
        hs.feed(bytes([b]))
        states.add(hs.state)
    assert states == {HandshakeState.AWAITING_HEADER, HandshakeState.SASL,
                      HandshakeState.AWAITING_AMQP_HEADER, HandshakeState.DONE}
    assert hs.user == "bob"
    assert hs.leftover == AMQP + OPEN_FRAME


def test_scram_split_feeding_byte_by_byte(store):
    hs = make(store)
    for b in SASL:
        hs.feed(bytes([b]))
    read_server(hs, expect_header=True)
    client = ScramClient("bob", "secret")
    for b in init("SCRAM-SHA-256", client.first()):
        hs.feed(bytes([b]))
    server_first = read_server(hs)[0][1][0]
    for b in response(client.final(server_first)) + AMQP + OPEN_FRAME:
        hs.feed(bytes([b]))
    assert hs.state is HandshakeState.DONE and hs.user == "bob"
    assert hs.leftover == AMQP + OPEN_FRAME


def test_bytes_fed_after_done_go_to_leftover(store):
    hs = make(store)
    hs.feed(SASL + init("ANONYMOUS") + AMQP[:5])
    assert hs.state is HandshakeState.AWAITING_AMQP_HEADER
    hs.feed(AMQP[5:] + OPEN_FRAME[:4])
    assert hs.state is HandshakeState.DONE and hs.leftover == AMQP + OPEN_FRAME[:4]
    hs.feed(OPEN_FRAME[4:])
    assert hs.leftover == AMQP + OPEN_FRAME


def test_wrong_header_after_sasl_outcome(store):
    hs = make(store)
    hs.feed(SASL + init("ANONYMOUS"))
    hs.data_to_send()
    hs.feed(SASL)
    assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert hs.data_to_send() == AMQP
    assert "expected the AMQP protocol header" in hs.error


def test_oversized_frame_refused_before_body_arrives(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(struct.pack(">IBBH", 70_000, 2, 1, 0))
    assert "exceeds" in assert_failed(hs, SYS_PERM)


def _with_trailing_byte(f):
    """A valid frame whose body has one extra byte after the performative."""
    return struct.pack(">I", len(f) + 1) + f[4:] + b"\x40"


@pytest.mark.parametrize("bad, message", [
    (struct.pack(">IBBH", 12, 2, 0, 0) + b"\x00" * 4, "frame type 0x00"),  # AMQP frame during SASL
    (struct.pack(">IBBH", 12, 1, 1, 0) + b"\x00" * 4, "data offset"),
    (struct.pack(">IBBH", 4, 2, 1, 0), "smaller than"),
    (struct.pack(">IBBH", 11, 2, 1, 0) + b"\xff\xff\xff", "undecodable"),
    (_with_trailing_byte(init("PLAIN", b"\x00bob\x00secret")), "trailing"),
    (struct.pack(">IBBH", 10, 2, 1, 0) + b"\xa1\x00", "not a described type"),
    (frame(0x99, b"x"), "unknown SASL frame descriptor"),
    (frame(0, symbolic="amqp:open:list"), "unknown SASL frame descriptor"),
    (response(b"x"), "unexpected sasl-response"),
    (frame(0x44, ), "client sent server frame sasl-outcome"),
    (frame(0x41, None, b"x"), "malformed sasl-init"),
    (frame(0x41, symbol("PLAIN"), "\x00bob\x00secret"), "malformed sasl-init"),  # str, not binary
])
def test_malformed_frames_and_protocol_violations(store, bad, message):
    hs = make(store)
    start_sasl(hs)
    hs.feed(bad)
    err = assert_failed(hs, SYS_PERM)
    assert err.startswith("SASL protocol error") and message in err


def test_duplicate_init_during_scram(store):
    hs = make(store)
    start_sasl(hs)
    scram_challenge(hs, ScramClient("bob", "secret"))
    hs.feed(init("PLAIN", b"\x00bob\x00secret"))
    assert "duplicate sasl-init" in assert_failed(hs, SYS_PERM)


def test_empty_frames_are_skipped(store):
    hs = make(store)
    start_sasl(hs)
    hs.feed(struct.pack(">IBBH", 8, 2, 1, 0) + init("ANONYMOUS"))
    assert outcome_of(read_server(hs)) == [OK]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=40))
def test_random_input_never_raises(data, chunk):
    hs = Handshake(SaslPolicy(ALL, True), UserStore({"bob": "x"}))
    for payload in (SASL, data):
        for i in range(0, len(payload), chunk):
            hs.feed(payload[i:i + chunk])
    hs.data_to_send()
    assert hs.state in HandshakeState
    if hs.state is HandshakeState.FAILED:
        assert hs.error and hs.close_after_send


def test_internal_error_is_contained(store, monkeypatch):
    def boom(self, initial):
        raise RuntimeError("bug")

    monkeypatch.setattr(sasl_mod._Plain, "start", boom)
    hs = make(store)
    start_sasl(hs)
    hs.feed(init("PLAIN", b"\x00bob\x00secret"))
    assert "internal error" in assert_failed(hs, SYS)


def test_timeout_with_fake_clock(store):
    now = [100.0]
    hs = Handshake(SaslPolicy(ALL, False, handshake_timeout=5), store, clock=lambda: now[0])
    assert hs.deadline == 105.0
    start_sasl(hs)
    now[0] = 104.9
    assert not hs.check_timeout()
    now[0] = 105.0
    assert hs.check_timeout()
    assert "timed out" in assert_failed(hs, SYS_TEMP)
    assert not hs.check_timeout()  # already failed


def test_no_timeout_once_done(store):
    now = [0.0]
    hs = Handshake(SaslPolicy(ALL, True, handshake_timeout=1), store, clock=lambda: now[0])
    hs.feed(AMQP)
    now[0] = 10
    assert not hs.check_timeout() and hs.state is HandshakeState.DONE


# --------------------------------------------------------------------------
# end to end with proton's real client (Cyrus SASL)
# --------------------------------------------------------------------------


def proton_client(mech, user=None, password=None):
    transport = Transport()  # CLIENT mode
    sasl = transport.sasl()
    sasl.allowed_mechs(mech)
    sasl.allow_insecure_mechs = True  # PLAIN over a non-TLS (in-memory) transport
    conn = Connection()
    if user is not None:
        conn.user = user
        conn.password = password
    conn.hostname = "broker.example"
    transport.bind(conn)
    conn.open()
    return transport, conn


def pump(client, hs, max_rounds=50):
    """Move bytes between proton's client transport and our handshake in memory."""
    sent = []
    for _ in range(max_rounds):
        moved = False
        pending = client.pending()
        if pending > 0:
            data = bytes(client.peek(pending))
            client.pop(pending)
            sent.append(data)
            hs.feed(data)
            moved = True
        out = hs.data_to_send()
        if out:
            client.push(out)
            moved = True
        if not moved:
            break
    return b"".join(sent)


def test_proton_client_plain(store):
    client, conn = proton_client("PLAIN", "bob", "secret")
    hs = make(store)
    sent = pump(client, hs)
    assert client.sasl().outcome == 0
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("bob", "PLAIN")
    assert hs.leftover.startswith(AMQP)
    assert len(hs.leftover) > 8  # proton sends its open right behind the header
    assert sent.endswith(hs.leftover)


def test_proton_client_plain_wrong_password(store):
    client, conn = proton_client("PLAIN", "bob", "nope")
    hs = make(store)
    pump(client, hs)
    assert hs.state is HandshakeState.FAILED and hs.close_after_send
    assert client.sasl().outcome == 1
    assert client.condition is not None and "unauthorized" in client.condition.name


def test_proton_client_anonymous(store):
    client, conn = proton_client("ANONYMOUS")
    hs = make(store, anonymous_user="guest")
    pump(client, hs)
    assert client.sasl().outcome == 0
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("guest", "ANONYMOUS")
    assert hs.leftover.startswith(AMQP)


def test_proton_client_scram_sha_256(store):
    client, conn = proton_client("SCRAM-SHA-256", "bob", "secret")
    hs = make(store)
    pump(client, hs)
    assert client.sasl().outcome == 0, client.condition
    assert hs.state is HandshakeState.DONE
    assert (hs.user, hs.mechanism) == ("bob", "SCRAM-SHA-256")
    assert hs.leftover.startswith(AMQP)


def test_proton_client_scram_wrong_password(store):
    client, conn = proton_client("SCRAM-SHA-256", "bob", "nope")
    hs = make(store)
    pump(client, hs)
    assert hs.state is HandshakeState.FAILED
    assert client.sasl().outcome == 1


def test_leftover_feeds_a_proton_server_transport(store):
    """The intended wiring: after DONE, a SASL-less proton server transport takes
    over from ``leftover`` and the AMQP connection opens on both sides."""
    client, client_conn = proton_client("SCRAM-SHA-256", "bob", "secret")
    hs = make(store)
    pump(client, hs)
    assert hs.state is HandshakeState.DONE
    server = Transport(Transport.SERVER)
    server_conn = Connection()
    server.bind(server_conn)
    server.push(hs.leftover)
    server_conn.open()
    for _ in range(10):
        for src, dst in ((server, client), (client, server)):
            n = src.pending()
            if n > 0:
                dst.push(bytes(src.peek(n)))
                src.pop(n)
    assert server_conn.state & Endpoint.REMOTE_ACTIVE
    assert client_conn.state & Endpoint.REMOTE_ACTIVE
    assert server_conn.remote_hostname == "broker.example"


# --------------------------------------------------------------------------
# the user store in force at authentication (a live reload meanwhile)
# --------------------------------------------------------------------------


def test_plain_uses_the_store_in_force_when_the_client_authenticates(store):
    stores = {"now": store}
    hs = Handshake(SaslPolicy(ALL, False), lambda: stores["now"])
    start_sasl(hs)
    stores["now"] = UserStore({"alice": "wonderland"})      # bob removed after accept
    hs.feed(init("PLAIN", b"\0bob\0secret"))
    assert "unknown user" in assert_failed(hs)
    assert hs.attempted_user == "bob"


def test_scram_fails_when_the_user_is_removed_between_its_messages(store):
    stores = {"now": store}
    hs = Handshake(SaslPolicy(ALL, False), lambda: stores["now"])
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    server_first = scram_challenge(hs, client)
    stores["now"] = UserStore({"alice": "wonderland"})
    hs.feed(response(client.final(server_first)))
    assert "unknown user" in assert_failed(hs)


def test_scram_passes_when_a_reload_keeps_the_user_as_it_was(store):
    kept = hash_password("secret", iterations=64)
    stores = {"now": UserStore({"bob": kept})}
    hs = Handshake(SaslPolicy(ALL, False), lambda: stores["now"])
    start_sasl(hs)
    client = ScramClient("bob", "secret")
    server_first = scram_challenge(hs, client)
    stores["now"] = UserStore({"bob": kept, "carol": "x"})   # a reload that changed someone else
    hs.feed(response(client.final(server_first)))
    assert outcome_of(read_server(hs))[0] == OK
