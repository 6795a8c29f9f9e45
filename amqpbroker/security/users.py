"""Password hashing and the user store used by SASL authentication.

Passwords are kept only as SCRAM-SHA-256 verifiers (RFC 5802 §3, RFC 7677):
``StoredKey = H(HMAC(SaltedPassword, "Client Key"))`` and
``ServerKey = HMAC(SaltedPassword, "Server Key")`` where
``SaltedPassword = PBKDF2-HMAC-SHA-256(SASLprep(password), salt, iterations)``.
The plaintext cannot be recovered from them, yet they serve both mechanisms:

* SCRAM-SHA-256 uses them directly;
* PLAIN recomputes StoredKey from the offered password and compares it in
  constant time.

The textual form produced by :func:`hash_password` is::

    scram-sha-256$<iterations>$<b64 salt>$<b64 StoredKey>$<b64 ServerKey>

(standard base64 with padding).  Generate one with e.g.::

    python -c 'from amqpbroker.security.users import hash_password as h; print(h("secret"))'
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import logging
import secrets
import stringprep
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..core.numbers import ascii_int

log = logging.getLogger("amqpbroker.users")

__all__ = [
    "HASH_PREFIX",
    "DEFAULT_ITERATIONS",
    "ScramCredentials",
    "UserStore",
    "derive_scram_credentials",
    "hash_password",
    "parse_password_hash",
    "saslprep",
    "users_from",
]

HASH_PREFIX = "scram-sha-256$"
DEFAULT_ITERATIONS = 4096  # RFC 7677 §4: SHOULD be at least 4096
_MAX_ITERATIONS = 10_000_000  # sanity bound: a typo here would stall every login
_KEY_LEN = 32  # SHA-256 output size


@dataclass(frozen=True)
class ScramCredentials:
    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes

    def __repr__(self) -> str:  # keep key material out of logs
        return f"ScramCredentials(iterations={self.iterations}, salt=<{len(self.salt)} bytes>, ...)"


# --------------------------------------------------------------------------
# SASLprep (RFC 4013), the "Normalize" of RFC 5802 §2.2
# --------------------------------------------------------------------------


def saslprep(s: str) -> str:
    """SASLprep profile of stringprep (RFC 4013) for stored strings.

    Raises ValueError if the string contains prohibited or unassigned code
    points or violates the bidi rules.
    """
    # RFC 4013 §2.1 mapping: non-ASCII spaces -> SPACE, "commonly mapped to
    # nothing" characters removed.
    mapped = []
    for c in s:
        if stringprep.in_table_c12(c):
            mapped.append(" ")
        elif not stringprep.in_table_b1(c):
            mapped.append(c)
    out = unicodedata.normalize("NFKC", "".join(mapped))  # §2.2
    prohibited = (
        stringprep.in_table_c12, stringprep.in_table_c21_c22, stringprep.in_table_c3,
        stringprep.in_table_c4, stringprep.in_table_c5, stringprep.in_table_c6,
        stringprep.in_table_c7, stringprep.in_table_c8, stringprep.in_table_c9,
        stringprep.in_table_a1,  # §2.5: unassigned code points (stored strings)
    )
    for c in out:
        if any(table(c) for table in prohibited):
            raise ValueError(f"SASLprep: prohibited character U+{ord(c):04X}")
    # §2.4 -> RFC 3454 §6 bidi rules
    if out and any(stringprep.in_table_d1(c) for c in out):
        if any(stringprep.in_table_d2(c) for c in out):
            raise ValueError("SASLprep: mixed right-to-left and left-to-right text")
        if not (stringprep.in_table_d1(out[0]) and stringprep.in_table_d1(out[-1])):
            raise ValueError("SASLprep: right-to-left text must start and end with an R/AL char")
    return out


def _normalize_password(password: str) -> bytes:
    """RFC 5802 §2.2 Normalize(); like PostgreSQL, fall back to the raw UTF-8
    when SASLprep refuses the string (e.g. emoji, unassigned in Unicode 3.2)."""
    try:
        password = saslprep(password)
    except ValueError:
        pass
    return password.encode("utf-8")


# --------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------


def derive_scram_credentials(password: str, salt: bytes, iterations: int) -> ScramCredentials:
    """RFC 5802 §3 key derivation with SHA-256 (RFC 7677)."""
    if not isinstance(iterations, int) or isinstance(iterations, bool) or not (
            1 <= iterations <= _MAX_ITERATIONS):
        raise ValueError(f"iterations must be an integer in 1..{_MAX_ITERATIONS}, got {iterations!r}")
    if not salt:
        raise ValueError("salt must not be empty")
    salted = hashlib.pbkdf2_hmac("sha256", _normalize_password(password), bytes(salt), iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    return ScramCredentials(iterations, bytes(salt), hashlib.sha256(client_key).digest(), server_key)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS,
                  salt: bytes | None = None) -> str:
    """Hash ``password`` into the self-describing ``scram-sha-256$...`` form."""
    if not isinstance(password, str):
        raise TypeError("password must be a str")
    if salt is None:
        salt = secrets.token_bytes(16)
    c = derive_scram_credentials(password, salt, iterations)
    return f"{HASH_PREFIX}{c.iterations}${_b64(c.salt)}${_b64(c.stored_key)}${_b64(c.server_key)}"


def parse_password_hash(s: str) -> ScramCredentials:
    """Parse a string made by :func:`hash_password`; ValueError if malformed."""
    if not isinstance(s, str) or not s.startswith(HASH_PREFIX):
        raise ValueError(f"password hash must start with {HASH_PREFIX!r}")
    parts = s[len(HASH_PREFIX):].split("$")
    if len(parts) != 4:
        raise ValueError(
            "password hash must have the form "
            "'scram-sha-256$<iterations>$<b64 salt>$<b64 StoredKey>$<b64 ServerKey>'")
    iters, salt_b64, stored_b64, server_b64 = parts
    iterations = ascii_int(iters)
    if iterations is None:
        raise ValueError(f"password hash: iteration count {iters!r} is not a positive integer")
    if not 1 <= iterations <= _MAX_ITERATIONS:
        raise ValueError(f"password hash: iteration count {iterations} out of range 1..{_MAX_ITERATIONS}")
    decoded = []
    for name, value in (("salt", salt_b64), ("StoredKey", stored_b64), ("ServerKey", server_b64)):
        try:
            decoded.append(base64.b64decode(value.encode("ascii"), validate=True))
        except (binascii.Error, UnicodeEncodeError):
            raise ValueError(f"password hash: {name} is not valid base64") from None
    salt, stored_key, server_key = decoded
    if not salt:
        raise ValueError("password hash: salt is empty")
    for name, key in (("StoredKey", stored_key), ("ServerKey", server_key)):
        if len(key) != _KEY_LEN:
            raise ValueError(f"password hash: {name} must be {_KEY_LEN} bytes, got {len(key)}")
    return ScramCredentials(iterations, salt, stored_key, server_key)


# --------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------


class UserStore:
    """Users and their SCRAM-SHA-256 verifiers.

    ``users`` maps a user name to either a hash string from
    :func:`hash_password` (``"scram-sha-256$..."``) or, for convenience in
    tests and development, a plaintext password which is hashed at load with a
    random salt.  Production configurations should store hashes only: any
    value that does not start with ``"scram-sha-256$"`` is taken as plaintext.

    ``accounts`` names every configured user, those without a password too (they
    log in by TLS client certificate only, SASL EXTERNAL): :meth:`has_account`.
    """

    def __init__(self, users: Mapping[str, str], accounts: Iterable[str] = ()) -> None:
        self._users: dict[str, ScramCredentials] = {}
        for name, value in users.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"user name must be a non-empty string, got {name!r}")
            if "\x00" in name:
                raise ValueError(f"user name {name!r} must not contain NUL")
            if not isinstance(value, str):
                raise ValueError(f"user {name!r}: password must be a string")
            if value.startswith(HASH_PREFIX):
                try:
                    self._users[name] = parse_password_hash(value)
                except ValueError as exc:
                    raise ValueError(f"user {name!r}: {exc}") from None
            else:
                log.warning("user %r has a plaintext password in the configuration: store the "
                            "output of `amqpbroker hash-password` instead", name)
                self._users[name] = derive_scram_credentials(
                    value, secrets.token_bytes(16), DEFAULT_ITERATIONS)
        # Unknown users are checked against this so that they cost the same
        # PBKDF2 work as real ones (use the most common iteration count).
        counts = collections.Counter(c.iterations for c in self._users.values())
        iterations = counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS
        self._dummy = ScramCredentials(iterations, secrets.token_bytes(16),
                                       secrets.token_bytes(_KEY_LEN), secrets.token_bytes(_KEY_LEN))
        self._decoy_key = secrets.token_bytes(32)
        self._accounts = frozenset(accounts) | frozenset(self._users)

    def verify_plain(self, user: str, password: str) -> bool:
        """Check a cleartext password (SASL PLAIN) in constant time."""
        creds = self._users.get(user)
        known = creds is not None
        if creds is None:
            creds = self._dummy
        try:
            candidate = derive_scram_credentials(password, creds.salt, creds.iterations)
        except (ValueError, TypeError):
            return False
        ok = hmac.compare_digest(candidate.stored_key, creds.stored_key)
        return ok and known

    def scram_credentials(self, user: str) -> ScramCredentials | None:
        return self._users.get(user)

    def decoy_scram_credentials(self, user: str) -> ScramCredentials:
        """Fake credentials for a user that does not exist.

        SCRAM must answer the client-first message with a salt and iteration
        count before the password is checked; answering unknown users with a
        stable per-store pseudo-random salt (same one every attempt, like a
        real user) and the usual iteration count hides whether the user
        exists.  The keys are random and never match (callers must still
        treat the user as unknown).
        """
        mac = hmac.digest(self._decoy_key, user.encode("utf-8", "surrogatepass"), "sha256")
        return ScramCredentials(self._dummy.iterations, mac[:16],
                                self._dummy.stored_key, self._dummy.server_key)

    def has_account(self, user: str) -> bool:
        """A configured user, with or without a password (EXTERNAL's check)."""
        return user in self._accounts

    def __contains__(self, user: object) -> bool:
        return user in self._users

    def __len__(self) -> int:
        return len(self._users)

    def __repr__(self) -> str:
        return f"UserStore(<{len(self._users)} users>)"


def users_from(configured: Mapping[str, object]) -> UserStore:
    """The store of `[users]` (name → an object with `password`, None for a user who
    logs in by certificate only): every name an account, passwords where given."""
    return UserStore({name: u.password for name, u in configured.items()  # type: ignore[attr-defined]
                      if getattr(u, "password", None) is not None}, accounts=configured)
