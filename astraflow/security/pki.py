"""A private certificate authority for a secured cluster: its own CA, a server certificate for the
TLS listeners and one client certificate per role (the log authenticates a client by it).

Made with ``cryptography`` (ECDSA P-256, SHA-256), as PEM bytes; :mod:`astraflow.security.material`
decides where they are kept.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825
"""Lifetime of every certificate issued here (the longest that common TLS clients accept for a leaf)."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "AstraFlow"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of two machines differ
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def make_ca(common_name: str = "AstraFlow cluster CA") -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _issue(ca: KeyPair, common_name: str, usage, sans: list[x509.GeneralName]) -> KeyPair:
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(_name(common_name), ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_server(ca: KeyPair, hosts: list[str]) -> KeyPair:
    """A server certificate valid for every name or IP address in ``hosts`` (clients check it)."""
    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    return _issue(ca, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, sans)


def issue_client(ca: KeyPair, role: str) -> KeyPair:
    """A client certificate whose common name is the role (``node``, ``trainer``, ...)."""
    return _issue(ca, role, ExtendedKeyUsageOID.CLIENT_AUTH, [])
