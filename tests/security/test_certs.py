"""security/certs.py: the user a verified client certificate names.  Certificates
are made with `cryptography` (self-signed, EC keys: quick), in DER as the TLS layer
hands them over; subjects with escaped commas, multi-valued RDNs, several CNs, none."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from amqpbroker.core.dn import dn_key, parse_dn
from amqpbroker.security.certs import CertIdentities

_KEY = ec.generate_private_key(ec.SECP256R1())


def der(*rdns: list[tuple]) -> bytes:
    """A certificate whose subject has these RDNs, in certificate order (the RFC 4514
    string lists them last first); each RDN a list of (oid, value)."""
    subject = x509.Name([x509.RelativeDistinguishedName([x509.NameAttribute(o, v) for o, v in rdn])
                         for rdn in rdns])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(x509.Name([]) if not rdns else subject)
            .public_key(_KEY.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(_KEY, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


CN, O, OU, C, UID = (NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME,
                     NameOID.COUNTRY_NAME, NameOID.USER_ID)
APP1 = der([(C, "DE")], [(O, "Example, Inc.")], [(CN, "app1")])


def users(mode: str = "cn", by_dn: dict | None = None, by_cn: dict | None = None) -> CertIdentities:
    return CertIdentities.from_settings(mode, by_dn, by_cn)


def test_the_cn_is_the_default_user_and_the_subject_reads_rfc4514():
    who = users().identify(APP1)
    assert who.user == "app1"
    assert who.subject == r"CN=app1,O=Example\, Inc.,C=DE"
    assert users("subject").identify(APP1).user == r"CN=app1,O=Example\, Inc.,C=DE"


def test_a_dn_key_with_an_escaped_comma_matches_as_a_dn():
    assert users(by_dn={r"CN=app1,O=Example\, Inc.,C=DE": "billing"}).identify(APP1).user == "billing"
    # Case and insignificant spaces in values do not matter (caseIgnoreMatch, RFC 4518
    # §2.6.1); the attribute types' spelling neither (RFC 4514 names or the OID).
    assert users(by_dn={r"CN=APP1,O=example\,  inc.,C=de": "billing"}).identify(APP1).user == "billing"
    assert users(by_dn={r"2.5.4.3=app1,O=Example\, Inc.,C=DE": "billing"}).identify(APP1).user == "billing"
    # ... but the RDNs and their order do.
    assert users(by_dn={r"CN=app1,O=Example\, Inc.": "billing"}).identify(APP1).user == "app1"
    assert users(by_dn={r"C=DE,O=Example\, Inc.,CN=app1": "billing"}).identify(APP1).user == "app1"


def test_a_cn_that_spells_a_dn_never_matches_that_dn():
    """The finding: one table for DNs and CNs let the CN `CN=billing-01,O=Example`
    reach the user of the DN `CN=billing-01,O=Example`."""
    lookalike = der([(CN, "CN=billing-01,O=Example")])
    real = der([(O, "Example")], [(CN, "billing-01")])
    ids = users(by_dn={"CN=billing-01,O=Example": "billing"})
    assert ids.identify(real).user == "billing"
    assert ids.identify(lookalike).user == "CN=billing-01,O=Example"   # its own CN, not "billing"
    assert ids.identify(lookalike).subject == r"CN=CN=billing-01\,O=Example"
    # And a CN key never matches a DN: a CN table entry spelling a DN is that CN only.
    by_cn = users(by_cn={"CN=billing-01,O=Example": "lookalike-user"})
    assert by_cn.identify(real).user == "billing-01"
    assert by_cn.identify(lookalike).user == "lookalike-user"


def test_multi_valued_rdns_compare_as_sets():
    cert = der([(O, "Example")], [(OU, "ops"), (UID, "#7")])
    ids = users(by_dn={r"UID=\#7+OU=ops,O=Example": "ops-7"})
    assert ids.identify(cert).user == "ops-7"
    assert ids.identify(cert).subject in (r"OU=ops+UID=\#7,O=Example", r"UID=\#7+OU=ops,O=Example")
    # A multi-valued RDN is not two RDNs.
    split = users(by_dn={r"UID=\#7,OU=ops,O=Example": "ops-7"})
    assert split.identify(cert).user is None       # no CN, no mapping


def test_several_cns_name_no_one_unless_the_whole_dn_is_mapped():
    cert = der([(O, "Example")], [(CN, "app1")], [(CN, "admin")])
    who = users().identify(cert)
    assert who.user is None and "2 CNs: ambiguous" in who.why
    assert users(by_cn={"app1": "x", "admin": "root"}).identify(cert).user is None
    assert users(by_dn={"CN=admin,CN=app1,O=Example": "pair"}).identify(cert).user == "pair"
    assert users("subject").identify(cert).user == "CN=admin,CN=app1,O=Example"


def test_no_cn():
    cert = der([(O, "Example")], [(OU, "ops")])
    who = users().identify(cert)
    assert who.user is None and "has no CN" in who.why
    assert users(by_dn={"OU=ops,O=Example": "ops"}).identify(cert).user == "ops"


def test_no_certificate():
    assert users().identify(None).user is None
    assert users().identify(b"").why == "no client certificate"


@pytest.mark.parametrize("key", ["app1", "", "CN", "=app1", "CN=a,,O=b", "XYZ=1"])
def test_a_dn_key_that_is_no_dn_is_refused(key):
    with pytest.raises(ValueError, match="distinguished name"):
        users(by_dn={key: "someone"})


def test_two_spellings_of_one_dn_for_two_users_are_refused():
    with pytest.raises(ValueError, match="same subject"):
        users(by_dn={"CN=a,O=b": "one", "CN=A,O=B": "two"})


def test_dn_key_is_per_rdn_sets():
    assert dn_key(parse_dn("CN=a+OU=b,O=c")) == dn_key(parse_dn("OU=b+CN=a,O=c"))
    assert dn_key(parse_dn("CN=a,OU=b,O=c")) != dn_key(parse_dn("CN=a+OU=b,O=c"))


def test_the_setting_refuses_a_cn_key_in_cert_users(tmp_path):
    from amqpbroker.config import ConfigError, load_settings
    cfg = tmp_path / "b.toml"
    cfg.write_text('[tls]\ncert_file = "c"\nkey_file = "k"\n[tls.cert_users]\napp1 = "orders"\n')
    with pytest.raises(ConfigError, match="tls.cert_users.*distinguished name"):
        load_settings(cfg)
