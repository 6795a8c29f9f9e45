"""Who a verified TLS client certificate is: the user SASL EXTERNAL authenticates.
Pure: takes the certificate as `ssl.SSLSocket.getpeercert()` gives it (a dict).

RFC 4422 Appendix A: with EXTERNAL the authentication identity comes from outside
SASL, here the client certificate the TLS layer verified against the listener's
`client_ca_file`.  The user is, in this order:

1. `cert_users[subject]`: the whole subject as an RFC 4514 string
   (`CN=app1,O=Example,C=DE`: the last RDN of the certificate first);
2. `cert_users[CN]`: the subject's common name;
3. with `cert_user = "cn"` (default) the common name itself, with
   `cert_user = "subject"` the RFC 4514 subject string.
"""

from __future__ import annotations

from typing import Any, Mapping

_ATTR_NAMES = {   # ssl's long names → RFC 4514 §3 short names
    "commonName": "CN", "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST",
    "organizationName": "O", "organizationalUnitName": "OU", "streetAddress": "STREET",
    "domainComponent": "DC", "userId": "UID",
}


def _escape(value: str) -> str:
    """RFC 4514 §2.4: escape `,+"\\<>;`, and a leading `#` or space / trailing space."""
    out = "".join("\\" + c if c in ',+"\\<>;' else c for c in value)
    if out.startswith(("#", " ")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def subject_string(subject: Any) -> str:
    """RFC 4514 form of getpeercert()'s `subject` (a tuple of RDNs, each a tuple of
    (name, value) pairs, in certificate order): reversed, `+` inside an RDN."""
    rdns = []
    for rdn in reversed(tuple(subject or ())):
        rdns.append("+".join(f"{_ATTR_NAMES.get(name, name)}={_escape(str(value))}" for name, value in rdn))
    return ",".join(rdns)


def common_name(subject: Any) -> str | None:
    """The subject's most specific CN (the last one in certificate order)."""
    cn = None
    for rdn in tuple(subject or ()):
        for name, value in rdn:
            if name == "commonName":
                cn = str(value)
    return cn


def cert_identity(peercert: Mapping[str, Any] | None, mode: str = "cn",
                  mapping: Mapping[str, str] | None = None) -> str | None:
    """The user a verified client certificate names, or None (no certificate, or
    no name to take from it)."""
    if not peercert:
        return None
    subject = peercert.get("subject")
    dn = subject_string(subject)
    cn = common_name(subject)
    mapping = mapping or {}
    if dn in mapping:
        return mapping[dn]
    if cn is not None and cn in mapping:
        return mapping[cn]
    if mode == "subject":
        return dn or None
    return cn or None


__all__ = ["cert_identity", "common_name", "subject_string"]
