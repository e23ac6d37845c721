"""Serving certificates of the injection webhook, when cert-manager does not provide them.

Self-signed mode: the operator makes a CA and a serving certificate for the webhook
Service's DNS names at start, keeps both in memory and on its own emptyDir (never in a
Secret: the operator may not read Secrets), and renews them when a third of the
serving certificate's life is left. On every renewal it first publishes the new CA
next to the previous one in the MutatingWebhookConfiguration's `caBundle`, then
switches the server to the new certificate (kopf's server re-reads changed files), so
the API server trusts the webhook across the switch. One replica only: replicas would
each publish a CA of their own; HA installs use cert-manager.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_FILE, KEY_FILE, CA_FILE = "tls.crt", "tls.key", "ca.crt"  # cert-manager's names
DEFAULT_LIFETIME = datetime.timedelta(days=30)


@dataclass(frozen=True)
class ServingCert:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    not_after: datetime.datetime
    lifetime: datetime.timedelta

    def due(self, now: datetime.datetime) -> bool:
        """A third of the lifetime left: renew (cert-manager's default rule)."""
        return now >= self.not_after - self.lifetime / 3

    def write(self, directory: Path) -> None:
        """Replace the files atomically (the server must never read half a pair)."""
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in ((KEY_FILE, self.key_pem), (CA_FILE, self.ca_pem),
                           (CERT_FILE, self.cert_pem)):
            tmp = directory / f".{name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, directory / name)


def service_names(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local"]


def issue(dns_names: list[str], *, lifetime: datetime.timedelta = DEFAULT_LIFETIME,
          now: datetime.datetime | None = None) -> ServingCert:
    """A fresh CA and a serving certificate signed by it (P-256 keys)."""
    now = now or datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)  # clock skew between nodes
    ca_key = ec.generate_private_key(ec.SECP256R1())
    # A name of its own per CA: while the bundle holds the previous CA too, a client
    # must find the issuer of the certificate it is shown, not its successor.
    ca_serial = x509.random_serial_number()
    ca_name = x509.Name([x509.NameAttribute(
        NameOID.COMMON_NAME, f"kvquota-webhook-ca-{ca_serial:x}"[:64])])
    ca_key_id = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(ca_serial)
        .not_valid_before(start).not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca_key_id, critical=False)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True,
            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(now + lifetime)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                       critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
            ca_key_id), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return ServingCert(
        ca_pem=ca.public_bytes(pem),
        cert_pem=cert.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        not_after=now + lifetime,
        lifetime=lifetime,
    )
