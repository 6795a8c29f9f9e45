"""Distinguished names (RFC 4514 strings, RFC 5280 names) as the broker compares them:
RDN by RDN, the attributes of a multi-valued RDN as a set, values without regard to case
or insignificant spaces (RFC 4517 distinguishedNameMatch, caseIgnoreMatch; RFC 4518
§2.6.1).  Pure (`cryptography`'s x509 names): the configuration checks `[tls.cert_users]`
keys with it when it loads, and security/certs.py maps certificates' subjects with it."""

from __future__ import annotations

import re
from typing import Any, Mapping

from cryptography import x509

_SPACES = re.compile(r"\s+")

# One attribute of a DN, compared: (OID dotted string, normalised value).
DnKey = tuple[frozenset[tuple[str, str]], ...]


def normalise(value: Any) -> str:
    """caseIgnoreMatch with insignificant space handling (RFC 4518 §2.6.1): case
    folded, leading and trailing spaces dropped, inner runs of spaces as one."""
    if isinstance(value, bytes):
        return value.hex()
    return _SPACES.sub(" ", str(value)).strip().casefold()


def dn_key(name: x509.Name) -> DnKey:
    """What two DNs are compared by: the RDN sequence, each RDN a set."""
    return tuple(frozenset((a.oid.dotted_string, normalise(a.value)) for a in rdn) for rdn in name.rdns)


def parse_dn(text: str) -> x509.Name:
    """An RFC 4514 string as a Name; ValueError when it is not one (no attribute
    type, bad escapes, an unknown attribute name)."""
    if not isinstance(text, str) or "=" not in text:
        raise ValueError(f"'{text}' is not a distinguished name (RFC 4514: 'CN=app1,O=Example')")
    try:
        name = x509.Name.from_rfc4514_string(text)
    except Exception as exc:   # cryptography raises ValueError, and others for odd input
        detail = f": {exc}" if str(exc) else ""
        raise ValueError(f"'{text}' is not a distinguished name (RFC 4514: TYPE=value joined by ',', "
                         f"no spaces around it; types such as CN, O, OU, C, or dotted OIDs){detail}") from None
    if not name.rdns:
        raise ValueError(f"'{text}' is an empty distinguished name")
    return name


def dn_map(cert_users: Mapping[str, str]) -> dict[DnKey, str]:
    """`[tls.cert_users]` keyed by DN; ValueError for a key that is no DN, or two keys
    naming the same subject with different users."""
    by_dn: dict[DnKey, str] = {}
    for text, user in cert_users.items():
        key = dn_key(parse_dn(text))
        if key in by_dn and by_dn[key] != user:
            raise ValueError(f"cert_users: '{text}' names the same subject as another key "
                             f"with another user")
        by_dn[key] = user
    return by_dn
