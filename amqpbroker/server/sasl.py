"""Sans-I/O server side of the AMQP 1.0 protocol-header and SASL handshake.

One :class:`Handshake` per accepted connection: the caller feeds it the bytes
received from the socket (:meth:`Handshake.feed`), writes out whatever
:meth:`Handshake.data_to_send` returns, closes the socket after that write when
:attr:`Handshake.close_after_send` is set, and once :attr:`Handshake.state` is
``DONE`` pushes :attr:`Handshake.leftover` (which starts with the plain AMQP
protocol header) into a proton ``Transport(Transport.SERVER)`` created without
proton's own SASL layer.  No sockets, no asyncio, no clocks unless asked.

Mechanisms: EXTERNAL (RFC 4422 Appendix A: the identity of a verified TLS client
certificate), SCRAM-SHA-256 (RFC 5802/7677), PLAIN (RFC 4616) and ANONYMOUS
(RFC 4505).  AMQP references are to the AMQP 1.0 core specification.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from amqpbroker.security.users import ScramCredentials, UserStore
from amqpbroker.server.sasl_frames import (
    AMQP_HEADER,
    HEADER_SIZE,
    SASL_HEADER,
    TLS_HEADER,
    FrameError,
    FrameReader,
    SaslCode,
    SaslFrame,
    SaslFrameType,
    encode_challenge,
    encode_mechanisms,
    encode_outcome,
)

__all__ = ["HandshakeState", "SaslPolicy", "Handshake", "SUPPORTED_MECHANISMS", "UserSource"]

# The user store, or what gives the one in force: a live reload replaces the
# broker's store, and a handshake asks for it when it authenticates (never the
# one of the moment its socket was accepted).
UserSource = Union[UserStore, Callable[[], UserStore]]


def _current(users: UserSource) -> UserStore:
    return users() if callable(users) else users

# Offered in this order: AMQP 1.0 §5.3.3.1 "ordered in decreasing level of preference".
SUPPORTED_MECHANISMS = ("EXTERNAL", "SCRAM-SHA-256", "PLAIN", "ANONYMOUS")


class HandshakeState(enum.Enum):
    AWAITING_HEADER = "awaiting-header"
    SASL = "sasl"
    AWAITING_AMQP_HEADER = "awaiting-amqp-header"
    DONE = "done"
    FAILED = "failed"


@dataclass
class SaslPolicy:
    mechanisms: tuple[str, ...]
    allow_no_sasl: bool
    anonymous_user: str = "anonymous"
    # Seconds a client may take to finish the handshake; see Handshake.check_timeout().
    handshake_timeout: float | None = 30.0

    def __post_init__(self) -> None:
        self.mechanisms = tuple(self.mechanisms)
        unknown = [m for m in self.mechanisms if m not in SUPPORTED_MECHANISMS]
        if unknown:
            raise ValueError(f"unsupported SASL mechanism(s) {unknown}; "
                             f"choose from {list(SUPPORTED_MECHANISMS)}")
        if not self.mechanisms and not self.allow_no_sasl:
            raise ValueError("no SASL mechanism enabled and allow_no_sasl is false: "
                             "no client could ever connect")

    @property
    def offered(self) -> tuple[str, ...]:
        return tuple(m for m in SUPPORTED_MECHANISMS if m in self.mechanisms)


# Mechanisms: start(initial-response) / step(response) -> _Challenge | _Success | _Failure


class _Challenge(NamedTuple):
    data: bytes


class _Success(NamedTuple):
    user: str
    additional_data: bytes | None = None


class _Failure(NamedTuple):
    reason: str
    code: SaslCode = SaslCode.AUTH


def _auth_failed(user: str, mech: str, why: str) -> _Failure:
    return _Failure(f"authentication failed for user {user!r} ({mech}): {why}")


class _Mechanism:
    name = ""
    # RFC 4422 §5: if the client sends no initial response and the mechanism
    # starts with the client, the server sends an empty challenge.
    needs_initial_response = True
    claimed: str | None = None      # the user name the client claimed, once known

    def start(self, initial: bytes):  # pragma: no cover - overridden
        raise NotImplementedError

    def step(self, response: bytes):
        return _Failure(f"unexpected sasl-response for {self.name}", SaslCode.SYS_PERM)


class _Anonymous(_Mechanism):
    name = "ANONYMOUS"
    needs_initial_response = False

    def __init__(self, anonymous_user: str) -> None:
        self.anonymous_user = anonymous_user

    def start(self, initial: bytes):
        # RFC 4505 §2: the optional message is trace information only.
        return _Success(self.anonymous_user)


class _External(_Mechanism):
    """RFC 4422 Appendix A: the client's message is an authorization identity, empty
    to act as the identity the TLS layer established (ours: security/certs.py).
    Acting as another identity is not supported: a different one fails.  The
    certificate's user must be a configured user (`[users]`, a password is not
    needed) in the store in force now: a user removed by a reload is refused."""
    name = "EXTERNAL"
    needs_initial_response = True

    def __init__(self, identity: Any, users: UserStore) -> None:
        # A plain name, or security/certs.Identity (user, subject, why).
        self.identity = getattr(identity, "user", identity)
        self.why = getattr(identity, "why", "") or "no verified client certificate names a user"
        self.subject = getattr(identity, "subject", "")
        self.users = users

    def start(self, initial: bytes):
        self.claimed = self.identity
        if self.identity is None:
            return _Failure(f"EXTERNAL: {self.why}")
        try:
            authzid = initial.decode("utf-8")
        except UnicodeDecodeError:
            return _Failure("malformed EXTERNAL response: not valid UTF-8")
        if authzid and authzid != self.identity:
            return _auth_failed(self.identity, self.name,
                                f"authorization identity {authzid!r} differs from the certificate's")
        if not self.users.has_account(self.identity):
            subject = f" (certificate subject '{self.subject}')" if self.subject else ""
            return _auth_failed(self.identity, self.name, f"not a configured user ([users]){subject}")
        return _Success(self.identity)


class _Plain(_Mechanism):
    name = "PLAIN"

    def __init__(self, users: UserStore) -> None:
        self.users = users

    def start(self, initial: bytes):
        # RFC 4616 §2: message = [authzid] UTF8NUL authcid UTF8NUL passwd
        parts = initial.split(b"\x00")
        if len(parts) != 3:
            return _Failure("malformed PLAIN response: expected authzid\\0authcid\\0passwd")
        try:
            authzid, authcid, passwd = (p.decode("utf-8") for p in parts)
        except UnicodeDecodeError:
            return _Failure("malformed PLAIN response: not valid UTF-8")
        if not authcid:
            return _Failure("malformed PLAIN response: empty user name")
        self.claimed = authcid
        if authzid and authzid != authcid:
            return _auth_failed(authcid, self.name,
                                f"authorization identity {authzid!r} differs from the user name")
        if self.users.verify_plain(authcid, passwd):
            return _Success(authcid)
        why = "invalid password" if authcid in self.users else "unknown user"
        return _auth_failed(authcid, self.name, why)


def _decode_saslname(s: str) -> str:
    """RFC 5802 §5.1: ',' and '=' are sent as '=2C' and '=3D'; any other '=' is invalid."""
    if re.search(r"=(?!2C|3D)", s):
        raise ValueError(f"invalid '=' escape in saslname {s!r}")
    return s.replace("=2C", ",").replace("=3D", "=")


def _valid_extensions(attrs: list[str]) -> bool:
    # RFC 5802 §7: extensions = attr-val *("," attr-val); attr-val = ALPHA "=" value
    return all(len(a) >= 2 and a[0].isascii() and a[0].isalpha() and a[1] == "=" for a in attrs)


def _server_nonce() -> str:
    return base64.b64encode(secrets.token_bytes(18)).decode("ascii")  # 144 random bits


def _valid_nonce(n: str) -> bool:
    # RFC 5802 §7: printable = %x21-2B / %x2D-7E (printable ASCII except ',')
    return bool(n) and all(0x21 <= ord(c) <= 0x7E and c != "," for c in n)


class _ScramSha256(_Mechanism):
    name = "SCRAM-SHA-256"

    def __init__(self, users: UserStore, current: Callable[[], UserStore] | None = None) -> None:
        self.users = users
        # The store in force when the proof arrives: a reload between the two
        # messages that removed the user (or changed the password) fails it.
        self.current = current or (lambda: users)
        self._stage = 0
        self.user = ""
        self._known = False
        self._creds: ScramCredentials | None = None
        self._gs2_header = ""
        self._first_bare = ""
        self._server_first = ""
        self._nonce = ""

    def _malformed(self, why: str) -> _Failure:
        return _Failure(f"malformed SCRAM-SHA-256 message: {why}")

    def start(self, initial: bytes):
        # RFC 5802 §7: client-first-message = gs2-header client-first-message-bare
        try:
            text = initial.decode("utf-8")
        except UnicodeDecodeError:
            return self._malformed("client-first-message is not valid UTF-8")
        if text.startswith("p="):
            return _Failure("SCRAM-SHA-256: client requires channel binding (gs2 flag 'p='), "
                            "which this server does not support")
        if text[:2] not in ("n,", "y,"):  # RFC 5802 §6: 'y' = client supports, thinks we don't
            return self._malformed("bad gs2-cbind-flag")
        end = text.find(",", 2)
        if end < 0:
            return self._malformed("truncated gs2-header")
        authzid_attr = text[2:end]
        self._gs2_header, self._first_bare = text[:end + 1], text[end + 1:]
        attrs = self._first_bare.split(",")
        if attrs[0].startswith("m="):  # RFC 5802 §5.1: unknown mandatory extension -> fail
            return _Failure("SCRAM-SHA-256: unsupported mandatory extension 'm='")
        if len(attrs) < 2 or not attrs[0].startswith("n=") or not attrs[1].startswith("r="):
            return self._malformed("client-first-message-bare must start with n=...,r=...")
        try:
            self.user = _decode_saslname(attrs[0][2:])
            authzid = _decode_saslname(authzid_attr[2:]) if authzid_attr.startswith("a=") else None
        except ValueError as exc:
            return self._malformed(str(exc))
        if authzid_attr and authzid is None:
            return self._malformed("bad authzid in gs2-header")
        if not self.user:
            return self._malformed("empty user name")
        self.claimed = self.user
        c_nonce = attrs[1][2:]
        if not _valid_nonce(c_nonce):
            return self._malformed("invalid client nonce")
        if not _valid_extensions(attrs[2:]):
            return self._malformed("bad extension attribute in client-first-message")
        if authzid and authzid != self.user:
            return _auth_failed(self.user, self.name,
                                f"authorization identity {authzid!r} differs from the user name")
        creds = self.users.scram_credentials(self.user)
        self._known = creds is not None
        if creds is None:  # keep going with a decoy so the client cannot tell
            creds = self.users.decoy_scram_credentials(self.user)
        self._creds = creds
        self._nonce = c_nonce + _server_nonce()
        # RFC 5802 §7: server-first-message = nonce "," salt "," iteration-count
        self._server_first = (f"r={self._nonce},s={base64.b64encode(creds.salt).decode('ascii')},"
                              f"i={creds.iterations}")
        self._stage = 1
        return _Challenge(self._server_first.encode("ascii"))

    def step(self, response: bytes):
        if self._stage != 1 or self._creds is None:
            return super().step(response)
        self._stage = 2
        # RFC 5802 §7: client-final-message = channel-binding "," nonce ["," ext] "," proof
        try:
            text = response.decode("utf-8")
        except UnicodeDecodeError:
            return self._malformed("client-final-message is not valid UTF-8")
        without_proof, sep, proof_b64 = text.rpartition(",p=")
        attrs = without_proof.split(",")
        if not sep or len(attrs) < 2 or not attrs[0].startswith("c=") or not attrs[1].startswith("r="):
            return self._malformed("client-final-message must be c=...,r=...,p=...")
        try:
            cbind = base64.b64decode(attrs[0][2:], validate=True)
            proof = base64.b64decode(proof_b64, validate=True)
        except (binascii.Error, ValueError):
            return self._malformed("bad base64 in channel binding or proof")
        # RFC 5802 §5.1 "c=": base64 of the gs2-header (no cbind-data for n/y),
        # i.e. "biws" for "n,,".
        if cbind != self._gs2_header.encode("utf-8"):
            return self._malformed("channel binding does not echo the gs2-header")
        if not _valid_extensions(attrs[2:]):
            return self._malformed("bad extension attribute in client-final-message")
        if attrs[1][2:] != self._nonce:  # must be client nonce + our nonce
            return self._malformed("nonce does not match the one in server-first-message")
        if len(proof) != hashlib.sha256().digest_size:
            return self._malformed("client proof has the wrong length")
        # RFC 5802 §3: AuthMessage, ClientSignature, ClientKey = proof XOR signature
        auth_message = ",".join((self._first_bare, self._server_first, without_proof)).encode("utf-8")
        creds = self._creds
        signature = hmac.digest(creds.stored_key, auth_message, "sha256")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        ok = hmac.compare_digest(hashlib.sha256(client_key).digest(), creds.stored_key)
        if self._known and self.current().scram_credentials(self.user) != creds:
            self._known = False      # removed or changed by a reload meanwhile
        if not (ok and self._known):
            return _auth_failed(self.user, self.name,
                                "invalid proof" if self._known else "unknown user")
        # RFC 5802 §7 server-final-message "v=" ServerSignature, carried in the
        # additional-data of sasl-outcome (AMQP 1.0 §5.3.3.5).
        server_sig = hmac.digest(creds.server_key, auth_message, "sha256")
        return _Success(self.user, b"v=" + base64.b64encode(server_sig))


# The handshake state machine


class Handshake:
    """Protocol-header negotiation and SASL server for one connection."""

    def __init__(self, policy: SaslPolicy, users: UserSource, *,
                 clock: Callable[[], float] | None = None, external: Any = None) -> None:
        self.policy = policy
        self.users = users          # a store, or what gives the one in force (UserSource)
        # The verified client certificate's user (EXTERNAL), if any: a name, or
        # security/certs.Identity.
        self.external = external
        self._clock = clock or time.monotonic
        self.started_at = self._clock()
        self.state = HandshakeState.AWAITING_HEADER
        self.user: str | None = None
        self.attempted_user: str | None = None   # the name an attempt claimed (throttling)
        self.mechanism: str | None = None
        self.hostname: str | None = None  # from sasl-init, if the client sent one
        self.outcome: SaslCode | None = None  # the sasl-outcome code we sent, if any
        self.leftover = b""
        self.error: str | None = None
        self.close_after_send = False
        self._in = bytearray()
        self._out = bytearray()
        self._reader = FrameReader()
        self._mech: _Mechanism | None = None
        self._started = False  # has the mechanism seen its first message?
        self._awaiting_response = False

    # ---------------------------------------------------------------- public

    @property
    def deadline(self) -> float | None:
        t = self.policy.handshake_timeout
        return None if t is None else self.started_at + t

    def feed(self, data: bytes) -> None:
        """Process bytes received from the peer.  Never raises.

        Once DONE, further bytes are appended to :attr:`leftover`; once
        FAILED, they are ignored.
        """
        if self.state is HandshakeState.FAILED:
            return
        if self.state is HandshakeState.DONE:
            self.leftover += bytes(data)
            return
        self._in += data
        try:
            self._process()
        except Exception as exc:  # a bug of ours must not kill the broker's loop
            self._fail(f"internal error during handshake: {exc!r}",
                       SaslCode.SYS if self.state is HandshakeState.SASL else None)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def refuse(self, reason: str) -> None:
        """Replace an outcome not sent yet with a temporary failure (sys-temp): the
        authentication throttle answers nothing about the password then."""
        self._out.clear()
        self.user = None
        self.leftover = b""
        self._fail(reason, SaslCode.SYS_TEMP)

    def check_timeout(self) -> bool:
        """Fail the handshake if the client is too slow; True if timed out.

        The broker calls this from a timer (see :attr:`deadline`)."""
        if self.state in (HandshakeState.DONE, HandshakeState.FAILED) or self.deadline is None:
            return False
        if self._clock() < self.deadline:
            return False
        code = SaslCode.SYS_TEMP if self.state is HandshakeState.SASL else None
        self._fail(f"handshake timed out after {self.policy.handshake_timeout:g}s "
                   f"in state {self.state.value}", code)
        return True

    # -------------------------------------------------------------- internal

    def _fail(self, reason: str, code: SaslCode | None = None, header: bytes | None = None) -> None:
        """Record the failure; send an optional header and/or sasl-outcome, then close."""
        if header is not None:
            self._out += header
        if code is not None:
            self._out += encode_outcome(code)
            self.outcome = code
        self.error = reason
        self.state = HandshakeState.FAILED
        self.close_after_send = True
        self._in.clear()

    def _preferred_header(self) -> bytes:
        # AMQP 1.0 §2.2: on an unacceptable header, reply with one we support, then close.
        return SASL_HEADER if self.policy.offered else AMQP_HEADER

    def _process(self) -> None:
        while self.state not in (HandshakeState.DONE, HandshakeState.FAILED):
            if self.state is HandshakeState.SASL:
                try:
                    frame = self._reader.next_frame(self._in)
                except FrameError as exc:
                    self._fail(f"SASL protocol error: {exc}", SaslCode.SYS_PERM)
                    return
                if frame is None:
                    return
                self._on_frame(frame)
                continue
            header = self._read_header()
            if header is None:
                return
            if self.state is HandshakeState.AWAITING_HEADER:
                self._on_first_header(header)
            else:  # AWAITING_AMQP_HEADER
                self._on_amqp_header_after_sasl(header)

    def _read_header(self) -> bytes | None:
        """Next 8-byte protocol header, None if incomplete; fails early on garbage."""
        head = bytes(self._in[:4])
        if not b"AMQP".startswith(head):
            self._fail(f"client sent garbage instead of an AMQP protocol header: {head!r}",
                       header=self._preferred_header() if
                       self.state is HandshakeState.AWAITING_HEADER else AMQP_HEADER)
            return None
        if len(self._in) < HEADER_SIZE:
            return None
        return bytes(self._in[:HEADER_SIZE])

    def _on_first_header(self, header: bytes) -> None:
        # AMQP 1.0 §2.2 protocol header negotiation.
        if header == SASL_HEADER and self.policy.offered:
            del self._in[:HEADER_SIZE]
            # §5.3.2: server replies with its SASL header then sasl-mechanisms.
            self._out += SASL_HEADER + encode_mechanisms(self.policy.offered)
            self.state = HandshakeState.SASL
        elif header == SASL_HEADER:
            self._fail("client requested SASL but no SASL mechanism is enabled", header=AMQP_HEADER)
        elif header == AMQP_HEADER and self.policy.allow_no_sasl:
            self.user = self.policy.anonymous_user
            self._done()
        elif header == AMQP_HEADER:
            # §5.3.2: answering with the SASL header tells the client SASL is required.
            self._fail("client skipped SASL (plain AMQP header) but authentication is required",
                       header=SASL_HEADER)
        elif header == TLS_HEADER:
            # §5.2.1 TLS negotiation is not supported; TLS is done by the listener.
            self._fail("client requested in-band TLS negotiation (AMQP protocol id 2), "
                       "which is not supported; connect to a TLS port instead",
                       header=self._preferred_header())
        else:
            self._fail(f"unsupported AMQP protocol header {header!r}",
                       header=self._preferred_header())

    def _on_amqp_header_after_sasl(self, header: bytes) -> None:
        # AMQP 1.0 §5.3.2: after a successful outcome the client starts the
        # AMQP layer with the plain AMQP header.
        if header == AMQP_HEADER:
            self._done()
        else:
            self._fail(f"expected the AMQP protocol header after SASL, got {header!r}",
                       header=AMQP_HEADER)

    def _done(self) -> None:
        self.leftover = bytes(self._in)
        self._in.clear()
        self.state = HandshakeState.DONE

    def _on_frame(self, frame: SaslFrame) -> None:
        if frame.type is SaslFrameType.INIT:
            self._on_init(frame)
        elif frame.type is SaslFrameType.RESPONSE:
            if not self._awaiting_response or self._mech is None:
                self._fail("SASL protocol error: unexpected sasl-response", SaslCode.SYS_PERM)
                return
            response = frame.field(0)
            if response is None:
                response = b""
            if not isinstance(response, bytes):
                self._fail("SASL protocol error: sasl-response is not binary", SaslCode.SYS_PERM)
                return
            self._awaiting_response = False
            if self._started:
                self._apply(self._mech.step(response))
            else:
                self._started = True
                self._apply(self._mech.start(response))
        else:
            self._fail(f"SASL protocol error: client sent server frame "
                       f"sasl-{frame.type.name.lower()}", SaslCode.SYS_PERM)

    def _on_init(self, frame: SaslFrame) -> None:
        # AMQP 1.0 §5.3.3.2 sasl-init: [mechanism, initial-response?, hostname?]
        if self._mech is not None:
            self._fail("SASL protocol error: duplicate sasl-init", SaslCode.SYS_PERM)
            return
        mech, initial, hostname = frame.field(0), frame.field(1), frame.field(2)
        if not isinstance(mech, str) or not isinstance(initial, bytes | None) \
                or not isinstance(hostname, str | None):
            self._fail("SASL protocol error: malformed sasl-init", SaslCode.SYS_PERM)
            return
        mech = str(mech)
        self.hostname = hostname
        if mech not in self.policy.offered:
            self._fail(f"client chose SASL mechanism {mech!r}, which is not offered "
                       f"(offered: {', '.join(self.policy.offered)})", SaslCode.AUTH)
            return
        self.mechanism = mech
        users = _current(self.users)     # the store in force at authentication
        if mech == "ANONYMOUS":
            self._mech = _Anonymous(self.policy.anonymous_user)
        elif mech == "EXTERNAL":
            self._mech = _External(self.external, users)
        elif mech == "PLAIN":
            self._mech = _Plain(users)
        else:
            self._mech = _ScramSha256(users, lambda: _current(self.users))
        if initial is None and self._mech.needs_initial_response:
            # RFC 4422 §5 (3): no initial response -> empty challenge.
            self._out += encode_challenge(b"")
            self._awaiting_response = True
            return
        self._started = True
        self._apply(self._mech.start(initial or b""))

    def _apply(self, result) -> None:
        claimed = getattr(self._mech, "claimed", None)
        if claimed:
            self.attempted_user = claimed
        if isinstance(result, _Challenge):
            self._out += encode_challenge(result.data)  # §5.3.3.3
            self._awaiting_response = True
        elif isinstance(result, _Success):
            self._out += encode_outcome(SaslCode.OK, result.additional_data)  # §5.3.3.5
            self.outcome = SaslCode.OK
            self.user = result.user
            self.state = HandshakeState.AWAITING_AMQP_HEADER
        else:
            self._fail(result.reason, result.code)
