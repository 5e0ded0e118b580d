"""A per-deployment certificate authority for the KV transfer path's mutual TLS.

When a deployment's transfers can cross Ray nodes (`kv_transfer.tls: auto`, cluster/deploy/launch.py),
the deploying process creates one `DeploymentCa` and issues every instance a key and a certificate
from it (`issue`) at deploy time; the instances get them in their spec, as they get the cluster
token. The deployment keeps its CA for its life: when an instance restarts (Ray restarts it from
its original spec, so with its predecessor's certificate), the router hands it a fresh one from the
same CA (cluster/router/instance_client.py `restarted`). The CA's private key stays in the deploying
process's memory: it is never serialised, so no instance (and no file) ever holds it, and nobody can
issue another certificate of this deployment once the deployer is gone.

Every instance certificate names the one DNS name `TRANSFER_SERVER_NAME`; senders verify the
receiver's certificate against that name (gRPC's target name override) instead of its address,
because the address is only known once Ray has placed the actor. Identity is membership: any
certificate of this deployment's CA is a peer, and nothing else is.

The cryptography is the `cryptography` package's (X.509 building and signing, ECDSA P-256 keys).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from worker.kv_transfer.tls import TlsConfig

# The name in every instance certificate (and the name senders verify). Not resolvable on purpose:
# it is only ever compared, never looked up.
TRANSFER_SERVER_NAME = "kv-transfer.duet.invalid"
# Instance certificates (and the CA) are valid this long by default: longer than any deployment is
# expected to run, so that no transfer fails on an expired certificate mid-life.
DEFAULT_VALIDITY_DAYS = 365
# Clock skew between the deployer and the nodes that an instance certificate tolerates.
_BACKDATE = datetime.timedelta(minutes=10)


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class DeploymentCa:
    """One deployment's certificate authority: an in-memory key and its self-signed certificate."""

    def __init__(
        self,
        deployment_id: str,
        *,
        validity_days: int = DEFAULT_VALIDITY_DAYS,
        clock: Callable[[], datetime.datetime] = _utc_now,
    ) -> None:
        if validity_days < 1:
            raise ValueError(f"validity_days must be at least 1, got {validity_days}")
        self.deployment_id = deployment_id
        self.validity = datetime.timedelta(days=validity_days)
        self._clock = clock
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = clock()
        subject = _name(f"duet deployment {deployment_id} KV transfer CA")
        self._subject = subject
        self._certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            # The CA outlives its last certificate by a day, so none outlives its issuer.
            .not_valid_after(now + self.validity + datetime.timedelta(days=1))
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
            .sign(self._key, hashes.SHA256())
        )
        self.root_pem = self._certificate.public_bytes(serialization.Encoding.PEM)

    def __repr__(self) -> str:  # never print key material
        return f"DeploymentCa({self.deployment_id!r})"

    def __reduce__(self) -> object:
        # The CA key never leaves the deploying process: refuse to be pickled (Ray would pickle
        # anything handed to an actor).
        raise TypeError("a DeploymentCa stays in the deploying process; hand out issue()'s TlsConfig instead")

    def issue(self, instance_id: str) -> TlsConfig:
        """A fresh key and certificate for `instance_id`, usable as server and as client, and the
        CA certificate that its peers' certificates must chain to."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = self._clock()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(f"duet {self.deployment_id} {instance_id}"))
            .issuer_name(self._subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + self.validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TRANSFER_SERVER_NAME)]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        return TlsConfig(
            certificate_chain_pem=certificate.public_bytes(serialization.Encoding.PEM),
            private_key_pem=key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            root_certificates_pem=self.root_pem,
            require_client_auth=True,
            server_name_override=TRANSFER_SERVER_NAME,
        )
