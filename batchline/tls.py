"""TLS on the gateway's gRPC and REST ports: their certificate and key, and, for mutual TLS, the CA that
clients' certificates must be signed by. The files are re-read when they change, so a rotated
certificate is served without a restart: every new connection's handshake looks whether the files
changed since the last read (a stat of each); connections already open keep what they negotiated.
"""
from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """The TLS settings cannot work: the message names the setting and what is wrong with it."""


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    client_ca_file: str = ""  # set: clients must present a certificate signed by it (mutual TLS)

    @classmethod
    def of(cls, cert_file: str, key_file: str, client_ca_file: str = "") -> "TlsFiles | None":
        """The files, checked on entry; None when TLS is off (no certificate given)."""
        if not cert_file and not key_file:
            if client_ca_file:
                raise TlsConfigError("tls_client_ca_file needs tls_cert_file and tls_key_file: "
                                     "clients are checked only on a TLS port")
            return None
        if not (cert_file and key_file):
            missing = "tls_key_file" if cert_file else "tls_cert_file"
            raise TlsConfigError(f"{missing} is not set: TLS needs both a certificate and its private key")
        files = cls(cert_file, key_file, client_ca_file)
        for setting, path in files._paths():
            if not os.path.isfile(path):
                raise TlsConfigError(f"{setting} {path!r} is not a readable file")
        return files

    def _paths(self) -> list[tuple[str, str]]:
        paths = [("tls_cert_file", self.cert_file), ("tls_key_file", self.key_file)]
        return paths + ([("tls_client_ca_file", self.client_ca_file)] if self.client_ca_file else [])

    def _stamp(self) -> tuple:
        # Change times and inodes too: `cp -p` keeps a modification time.
        return tuple((st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                     for st in (os.stat(p) for _, p in self._paths()))

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        with open(self.key_file, "rb") as key, open(self.cert_file, "rb") as cert:
            pair = (key.read(), cert.read())
        ca = None
        if self.client_ca_file:
            with open(self.client_ca_file, "rb") as f:
                ca = f.read()
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Credentials for a gRPC server port that follow the files as they change."""
    stamp = [files._stamp()]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            now = files._stamp()
            if now == stamp[0]:
                return None
            configuration = files._configuration()
        except OSError as exc:
            # Mid-rotation (a file replaced but not yet its pair): keep serving the current ones.
            log.warning("TLS files not re-read (%s): the current certificate stays", exc)
            return None
        stamp[0] = now
        log.info("TLS certificate re-read from %s", files.cert_file)
        return configuration

    return grpc.dynamic_ssl_server_credentials(files._configuration(), fetch,
                                               require_client_authentication=bool(files.client_ca_file))


def ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """A server SSLContext (the REST port's) that follows the files as they change, as
    server_credentials does for gRPC: each handshake looks whether they changed and, if so, is
    served from a context built anew from them."""

    def build() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(files.cert_file, files.key_file)
        if files.client_ca_file:
            context.load_verify_locations(files.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    state = {"stamp": files._stamp(), "context": build()}
    outer = build()

    def pick(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        # OpenSSL calls this for every ClientHello, with or without a server name.
        try:
            now = files._stamp()
            if now != state["stamp"]:
                state["context"] = build()
                if files.client_ca_file:
                    # Which CA a client certificate is checked against stays the handshake's
                    # first context's: it learns the new CA (the old one is kept until a restart).
                    outer.load_verify_locations(files.client_ca_file)
                state["stamp"] = now
                log.info("TLS certificate re-read from %s (REST port)", files.cert_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS files not re-read (%s): the current certificate stays", exc)
        connection.context = state["context"]

    outer.sni_callback = pick
    return outer
