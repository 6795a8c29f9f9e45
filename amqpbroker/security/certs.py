"""Who a verified TLS client certificate is: the user SASL EXTERNAL authenticates.
Pure: takes the certificate in DER (`SSLObject.getpeercert(binary_form=True)`);
names are parsed and compared by `cryptography`'s x509 support (RFC 5280 names,
RFC 4514 strings).

RFC 4422 Appendix A: with EXTERNAL the authentication identity comes from outside
SASL, here the client certificate the TLS layer verified against the listener's
`client_ca_file`.  A mapping is keyed by what it maps, and the two kinds never
meet:

1. `[tls.cert_users]`: whole subjects (distinguished names, RFC 4514 strings such
   as `CN=app1,O=Example`) → user.  A key is parsed as a DN when the settings are
   loaded (a key that is no DN is a configuration error) and compared with the
   certificate's subject as a DN: RDN by RDN, the attributes of a multi-valued RDN
   as a set, values without regard to case or insignificant spaces (RFC 4517
   distinguishedNameMatch, caseIgnoreMatch; RFC 4518 §2.6.1).  A CN that happens
   to read `CN=app2,O=Example` is one RDN, never the two-RDN DN of that text.
2. `[tls.cert_cn_users]`: common names → user; only a subject with exactly one CN
   is looked up.
3. Otherwise `cert_user = "cn"` (default): the subject's CN itself (exactly one CN:
   a subject with several is ambiguous and names no one; one with none names no
   one); `cert_user = "subject"`: the subject's RFC 4514 string.

Whatever name comes out still has to be a configured user (`[users]`) at the moment
of login: server/sasl.py checks that, so a user removed by a reload cannot come
back with the certificate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from cryptography import x509
from cryptography.x509.oid import NameOID

from ..core.dn import DnKey, dn_key, dn_map, normalise


def subject_of(der: bytes) -> x509.Name:
    return x509.load_der_x509_certificate(der).subject


def common_names(name: x509.Name) -> list[str]:
    return [str(a.value) for a in name.get_attributes_for_oid(NameOID.COMMON_NAME)]


@dataclass(frozen=True)
class Identity:
    """What a certificate says: the user (None: none), and why (for the log)."""
    user: str | None
    subject: str
    why: str = ""


@dataclass
class CertIdentities:
    """A listener's rules (from `[tls]`): `identify(der)` → Identity."""
    mode: str = "cn"
    by_dn: dict[DnKey, str] = field(default_factory=dict)
    by_cn: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, mode: str = "cn", cert_users: Mapping[str, str] | None = None,
                      cert_cn_users: Mapping[str, str] | None = None) -> "CertIdentities":
        """ValueError for a `cert_users` key that is not a DN."""
        by_cn = {normalise(cn): user for cn, user in (cert_cn_users or {}).items()}
        return cls(mode, dn_map(cert_users or {}), by_cn)

    def identify(self, der: bytes | None) -> Identity:
        if not der:
            return Identity(None, "", "no client certificate")
        try:
            subject = subject_of(der)
        except Exception as exc:   # verified by the TLS layer already: should not happen
            return Identity(None, "", f"unreadable certificate: {exc}")
        return self.identify_name(subject)

    def identify_name(self, subject: x509.Name) -> Identity:
        text = subject.rfc4514_string()
        mapped = self.by_dn.get(dn_key(subject))
        if mapped is not None:
            return Identity(mapped, text)
        cns = common_names(subject)
        if len(cns) == 1 and normalise(cns[0]) in self.by_cn:
            return Identity(self.by_cn[normalise(cns[0])], text)
        if self.mode == "subject":
            return Identity(text or None, text, "" if text else "an empty subject")
        if not cns:
            return Identity(None, text, f"subject '{text}' has no CN")
        if len(cns) > 1:
            return Identity(None, text, f"subject '{text}' has {len(cns)} CNs: ambiguous")
        return Identity(cns[0], text)


def peer_certificate(sock: Any) -> bytes | None:
    """The verified client certificate of a TLS transport, in DER (asyncio and uvloop
    alike: `ssl_object`)."""
    ssl_object = sock.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    return ssl_object.getpeercert(binary_form=True)


__all__ = ["CertIdentities", "Identity", "common_names", "peer_certificate", "subject_of"]
