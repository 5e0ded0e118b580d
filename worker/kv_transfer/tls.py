"""Mutual TLS for the KV transfer path: both sides present certificates signed by the cluster's CA.

Loading PEM files is I/O at the edge (`TlsConfig.from_files`); the config itself is frozen bytes.
A receiver's certificate can be replaced while it serves (`ServerCertificates`): the deployer
reissues an instance's certificate when the instance restarts (cluster/deploy/launch.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """Missing or non-PEM certificate material (the message names the field)."""


def _check_pem(name: str, value: object) -> None:
    if not isinstance(value, bytes) or b"-----BEGIN " not in value:
        raise TlsConfigError(f"{name} must be PEM bytes")


@dataclass(frozen=True)
class TlsConfig:
    """This node's certificate chain and key, and the CA that peers' certificates must chain to."""

    certificate_chain_pem: bytes
    private_key_pem: bytes = field(repr=False)  # never printed
    root_certificates_pem: bytes
    # The server requires and verifies a client certificate (mutual TLS).
    require_client_auth: bool = True
    # Name to verify the server's certificate against instead of the host in the target address.
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        _check_pem("certificate_chain_pem", self.certificate_chain_pem)
        _check_pem("private_key_pem", self.private_key_pem)
        _check_pem("root_certificates_pem", self.root_certificates_pem)
        if self.server_name_override is not None and not self.server_name_override:
            raise TlsConfigError("server_name_override must be a non-empty name or None")

    @classmethod
    def from_files(
        cls,
        certificate_chain_path: str | Path,
        private_key_path: str | Path,
        root_certificates_path: str | Path,
        *,
        require_client_auth: bool = True,
        server_name_override: str | None = None,
    ) -> TlsConfig:
        return cls(
            certificate_chain_pem=Path(certificate_chain_path).read_bytes(),
            private_key_pem=Path(private_key_path).read_bytes(),
            root_certificates_pem=Path(root_certificates_path).read_bytes(),
            require_client_auth=require_client_auth,
            server_name_override=server_name_override,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key_pem, self.certificate_chain_pem)],
            root_certificates=self.root_certificates_pem,
            require_client_auth=self.require_client_auth,
        )

    def server_certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self.private_key_pem, self.certificate_chain_pem)], root_certificates=self.root_certificates_pem
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates_pem,
            private_key=self.private_key_pem,
            certificate_chain=self.certificate_chain_pem,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name_override is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name_override)]


class ServerCertificates:
    """A server's certificate, replaceable while it serves. gRPC asks `_fetch` before the handshake
    of every new connection; a replacement is handed over once (gRPC keeps it), and None means
    "keep the current one". Connections already open keep the certificate they were made with."""

    def __init__(self, tls: TlsConfig) -> None:
        self._lock = threading.Lock()
        self._current = tls
        self._pending: grpc.ServerCertificateConfiguration | None = None

    @property
    def current(self) -> TlsConfig:
        return self._current

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._current.server_certificate_configuration(),
            self._fetch,
            require_client_authentication=self._current.require_client_auth,
        )

    def replace(self, tls: TlsConfig) -> None:
        """Serve `tls` to every connection made from now on. Whether clients must authenticate is
        fixed when the server starts, so a replacement must agree with it."""
        if tls.require_client_auth != self._current.require_client_auth:
            raise TlsConfigError("require_client_auth cannot change while the server runs")
        with self._lock:
            self._current = tls
            self._pending = tls.server_certificate_configuration()

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending
