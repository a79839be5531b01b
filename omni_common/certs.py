"""`omnistage certs DIR`: a local certificate authority and one certificate per service.

For the local cluster, docker-compose and tests; a production deployment may bring its own CA
(cert-manager, a company PKI) and only needs the same file layout:

    DIR/ca.pem                       the CA every client verifies against (OMNISTAGE_TLS_CA)
    DIR/ca-key.pem                   the CA's key: signs the others; keep it out of the pods
    DIR/<service>.pem, -key.pem      a service's certificate and key (OMNISTAGE_TLS_CERT/KEY)

Each service certificate names the service (its compose / Kubernetes host name), localhost,
127.0.0.1, ::1, CLUSTER_NAME (which internal channels check: replicas register by IP) and any
extra hosts given. Keys are P-256, files mode 0600 in a 0700 directory. Existing files are kept
(a second run only adds what is missing, signed by the same CA); `force` makes everything anew,
which is how the certificates rotate (docs in the README).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omni_common.net.tls import CLUSTER_NAME
from omni_common.stages import STAGES

SERVICES = ("coordinator", *STAGES, "gateway")
CA_DAYS = 3650
SERVICE_DAYS = 397  # what browsers accept for a server certificate


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "omnistage"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _authority(directory: Path, force: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bool]:
    """The CA (made when missing or `force`), its key, and whether it is new."""
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if not force and cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise SystemExit(f"{key_path} is not an EC key made by `omnistage certs`")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key, False
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("omnistage local CA"))
        .issuer_name(_name("omnistage local CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert, key, True


def _alt_names(service: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([service, "localhost", CLUSTER_NAME, "127.0.0.1", "::1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _issue(
    directory: Path,
    service: str,
    hosts: Sequence[str],
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(service))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVICE_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_alt_names(service, hosts)), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(directory / f"{service}-key.pem", _key_pem(key), private=True)
    _write(directory / f"{service}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)


def make_certs(
    directory: Path, services: Sequence[str] = SERVICES, hosts: Sequence[str] = (), force: bool = False
) -> list[str]:
    """Make (or complete) `directory`'s CA and service certificates; returns the services whose
    certificate was made now."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca, ca_key, new_ca = _authority(directory, force)
    made = []
    for service in services:  # a new CA signs every certificate anew
        if (
            new_ca
            or not (directory / f"{service}.pem").exists()
            or not (directory / f"{service}-key.pem").exists()
        ):
            _issue(directory, service, hosts, ca, ca_key)
            made.append(service)
    return made
