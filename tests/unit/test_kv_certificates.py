"""The per-deployment CA of the KV transfer path: what it issues, for how long, and that its key stays put."""

from __future__ import annotations

import datetime
import pickle

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from worker.instance import InstanceSpec
from worker.kv_transfer.certificates import TRANSFER_SERVER_NAME, DeploymentCa

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)


def _load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def test_issued_certificates_chain_to_the_deployment_ca_and_name_the_transfer_server() -> None:
    ca = DeploymentCa("abc123", validity_days=30, clock=lambda: NOW)
    tls = ca.issue("prefill-0")
    leaf, root = _load(tls.certificate_chain_pem), _load(tls.root_certificates_pem)
    leaf.verify_directly_issued_by(root)  # raises unless the CA signed it
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == [TRANSFER_SERVER_NAME] and tls.server_name_override == TRANSFER_SERVER_NAME
    assert tls.require_client_auth
    assert leaf.not_valid_after_utc == NOW + datetime.timedelta(days=30)
    assert root.not_valid_after_utc > leaf.not_valid_after_utc  # no certificate outlives its issuer
    assert leaf.not_valid_before_utc < NOW  # tolerates a node clock a little behind the deployer's
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)


def test_every_instance_gets_its_own_key_and_other_deployments_do_not_chain() -> None:
    ca = DeploymentCa("abc123")
    first, second = ca.issue("prefill-0"), ca.issue("generation-0")
    assert first.private_key_pem != second.private_key_pem
    assert first.root_certificates_pem == second.root_certificates_pem == ca.root_pem
    with pytest.raises((ValueError, TypeError)):
        _load(DeploymentCa("other").issue("prefill-0").certificate_chain_pem).verify_directly_issued_by(_load(ca.root_pem))


def test_the_ca_key_never_leaves_the_deployer_and_no_key_is_printed() -> None:
    ca = DeploymentCa("abc123")
    with pytest.raises(TypeError):
        pickle.dumps(ca)
    tls = ca.issue("prefill-0")
    spec = InstanceSpec("prefill-0", transfer_tls=tls)
    assert InstanceSpec.from_bytes(spec.to_bytes()).transfer_tls == tls  # handed over as the token is
    assert b"PRIVATE KEY" not in repr(spec).encode() and b"PRIVATE KEY" not in repr(tls).encode()
    assert b"PRIVATE KEY" not in spec.to_bytes().replace(tls.private_key_pem, b"")  # only the instance's own key
    with pytest.raises(ValueError):
        DeploymentCa("abc123", validity_days=0)
