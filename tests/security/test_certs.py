"""security/certs.py: the user a verified client certificate names."""

from __future__ import annotations

from amqpbroker.security.certs import cert_identity, common_name, subject_string

# As ssl.SSLSocket.getpeercert() gives a subject: RDNs in certificate order.
CERT = {"subject": ((("countryName", "DE"),), (("organizationName", "Example, Inc."),),
                    (("commonName", "app1"),))}


def test_subject_in_rfc4514_order_with_escapes():
    assert subject_string(CERT["subject"]) == r"CN=app1,O=Example\, Inc.,C=DE"


def test_multi_valued_rdn_and_leading_hash():
    subject = ((("organizationalUnitName", "a"), ("userId", "#7")),)
    assert subject_string(subject) == r"OU=a+UID=\#7"


def test_common_name_is_the_default_user():
    assert cert_identity(CERT) == "app1"
    assert common_name(CERT["subject"]) == "app1"


def test_subject_mode():
    assert cert_identity(CERT, "subject") == r"CN=app1,O=Example\, Inc.,C=DE"


def test_mapping_by_subject_then_cn():
    by_subject = {r"CN=app1,O=Example\, Inc.,C=DE": "billing", "app1": "other"}
    assert cert_identity(CERT, "cn", by_subject) == "billing"
    assert cert_identity(CERT, "subject", {"app1": "orders"}) == "orders"


def test_no_certificate_or_no_cn():
    assert cert_identity(None) is None
    assert cert_identity({}) is None
    assert cert_identity({"subject": ((("organizationName", "x"),),)}) is None
