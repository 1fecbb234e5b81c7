"""The serving certificate: made for the Service's names, verified by its CA, renewed with a third of its life left,
the previous CA kept trusted; a broken Secret is one clear error."""

from __future__ import annotations

import base64
import datetime

import pytest
from cryptography import x509

from ipmasq.errors import CertificateError
from ipmasq.webhook.certificate import CertificateSet, issue, needs_renewal, service_names

NOW = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC)
NAMES = service_names("ipmasq-webhook", "kube-system")


def test_the_certificate_names_the_service_and_its_ca_signed_it() -> None:
    made = issue(NAMES, NOW, 365)
    cert = x509.load_pem_x509_certificate(made.tls_cert)
    ca = x509.load_pem_x509_certificate(made.ca_cert)
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ipmasq-webhook.kube-system.svc" in san.get_values_for_type(x509.DNSName)
    assert made.ca_bundle == made.ca_cert
    not_before, not_after = made.validity()
    assert not_before < NOW < not_after and not_after - NOW == datetime.timedelta(days=365)


def test_renewal_is_due_with_a_third_of_the_lifetime_left_or_for_other_names() -> None:
    made = issue(NAMES, NOW, 90)
    assert not needs_renewal(made, NAMES, NOW + datetime.timedelta(days=59))
    assert needs_renewal(made, NAMES, NOW + datetime.timedelta(days=61))
    assert needs_renewal(made, service_names("other", "kube-system"), NOW)


def test_a_renewed_set_keeps_the_previous_ca_trusted_while_it_is_valid() -> None:
    first = issue(NAMES, NOW, 90)
    second = issue(NAMES, NOW + datetime.timedelta(days=61), 90, previous=first)
    assert second.ca_bundle == second.ca_cert + first.ca_cert
    third = issue(NAMES, NOW + datetime.timedelta(days=200), 90, previous=second)
    assert third.ca_bundle == third.ca_cert  # the second CA expired at day 151


def test_the_secret_round_trip_and_broken_secrets() -> None:
    made = issue(NAMES, NOW, 30)
    assert CertificateSet.from_secret_data(made.secret_data()) == made
    data = made.secret_data()
    for broken, message in [(None, "no data"), ({k: v for k, v in data.items() if k != "tls.key"}, "no tls.key"),
                            ({**data, "ca.crt": "not base64!"}, "not base64"),
                            ({**data, "tls.crt": base64.b64encode(b"garbage").decode()}, "not a PEM certificate")]:
        with pytest.raises(CertificateError, match=message):
            CertificateSet.from_secret_data(broken)
