"""Real certificates for the TLS tests, made with `cryptography`: a CA and what it signs."""
from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Authority:
    """A CA that signs server and client certificates, written as PEM files under `root`."""

    def __init__(self, root, name: str) -> None:
        self.root, self.name = root, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        # Not the name of anything it signs: a leaf named like its issuer looks self-signed.
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
        self.cert = self._build(subject, self.key.public_key(), subject, ca=True)
        self.file = self._write(f"{name}-ca.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    def _build(self, subject, public_key, issuer, ca: bool = False, san=None) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def issue(self, name: str, server: bool = True) -> tuple[str, str]:
        """(certificate file, key file) for `name`; a server's is valid for 127.0.0.1 and localhost."""
        key = ec.generate_private_key(ec.SECP256R1())
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")] if server else None
        cert = self._build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key(),
                           self.cert.subject, san=san)
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return (self._write(f"{self.name}-{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                self._write(f"{self.name}-{name}.key", key_pem))
