"""The webhook's serving certificate: a private CA and a certificate it signs for the Service's DNS names.

Pure apart from randomness (the keys): the time is passed in. The set lives in one Secret that every replica serves
from, so the caBundle the API server trusts always names the CA of what any replica serves. Renewal makes a new CA
and certificate and keeps the old CA in the bundle while it is valid, so connections to a replica still serving the
old certificate verify until it reloads.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ipmasq.errors import CertificateError

__all__ = [
    "SECRET_KEYS", "CertificateSet", "issue", "needs_renewal", "service_names", "still_valid",
]

# The Secret's keys: tls.crt and tls.key as a kubernetes.io/tls Secret has them (cert-manager's too), ca.crt the CA
# that signed them, ca.key its key (to sign the next certificate), ca-bundle.crt what the caBundle must hold.
SECRET_KEYS = ("tls.crt", "tls.key", "ca.crt", "ca.key", "ca-bundle.crt")
# Renewed when less than this share of the certificate's lifetime is left: a third of a year is months of warning
# in the logs if renewal keeps failing, and a replica that was down for weeks still finds a valid certificate.
RENEW_SHARE = 1 / 3
_BACKDATE = datetime.timedelta(minutes=5)  # clocks of the API server and the webhook's node may differ a little


@dataclass(frozen=True, slots=True)
class CertificateSet:
    tls_cert: bytes  # PEM
    tls_key: bytes
    ca_cert: bytes
    ca_key: bytes
    ca_bundle: bytes  # every CA the API server must trust: the current one, and the previous one while it is valid

    def secret_data(self) -> dict[str, str]:
        """The Secret's `data`: every value base64, as the API takes it."""
        values = (self.tls_cert, self.tls_key, self.ca_cert, self.ca_key, self.ca_bundle)
        return {key: base64.b64encode(value).decode() for key, value in zip(SECRET_KEYS, values, strict=True)}

    @classmethod
    def from_secret_data(cls, data: object) -> CertificateSet:
        if not isinstance(data, Mapping):
            raise CertificateError("the Secret has no data")
        values: list[bytes] = []
        for key in SECRET_KEYS:
            value = data.get(key)
            if not isinstance(value, str):
                raise CertificateError(f"the Secret has no {key}")
            try:
                values.append(base64.b64decode(value, validate=True))
            except (binascii.Error, ValueError):
                raise CertificateError(f"the Secret's {key} is not base64") from None
        made = cls(*values)
        made.validity()  # parses the certificate: a broken Secret is found here, not when serving
        return made

    def validity(self) -> tuple[datetime.datetime, datetime.datetime]:
        """(not before, not after) of the serving certificate, in UTC."""
        try:
            cert = x509.load_pem_x509_certificate(self.tls_cert)
        except ValueError as exc:
            raise CertificateError(f"tls.crt is not a PEM certificate: {exc}") from None
        return cert.not_valid_before_utc, cert.not_valid_after_utc


def service_names(service: str, namespace: str) -> tuple[str, ...]:
    """The names the API server may use for the Service (it verifies service.namespace.svc)."""
    return (service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local")


def needs_renewal(current: CertificateSet, names: tuple[str, ...], now: datetime.datetime) -> bool:
    """Whether the set must be replaced: most of its lifetime used, or made for other names."""
    not_before, not_after = current.validity()
    if now + (not_after - not_before) * RENEW_SHARE >= not_after or now < not_before:
        return True
    cert = x509.load_pem_x509_certificate(current.tls_cert)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return True
    return set(san.get_values_for_type(x509.DNSName)) != set(names)


def issue(names: tuple[str, ...], now: datetime.datetime, days: float,
          previous: CertificateSet | None = None) -> CertificateSet:
    """A new CA and a certificate it signs for `names`, valid `days`; the previous CA stays trusted while valid."""
    start = now - _BACKDATE
    end = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ipmasq webhook CA {now:%Y-%m-%dT%H:%M:%SZ}")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    bundle = ca_pem
    if previous is not None and still_valid(previous.ca_cert, now):
        bundle += previous.ca_cert
    return CertificateSet(
        tls_cert=cert.public_bytes(serialization.Encoding.PEM),
        tls_key=_private_pem(key),
        ca_cert=ca_pem,
        ca_key=_private_pem(ca_key),
        ca_bundle=bundle,
    )


def still_valid(pem: bytes, now: datetime.datetime) -> bool:
    try:
        return x509.load_pem_x509_certificate(pem).not_valid_after_utc > now
    except ValueError:
        return False


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
