"""Bearer-token authentication (missing / malformed / wrong / right; health exempt; refused calls
never reach the router) and TLS, server-only and mutual, with certificates made in the test."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_frontend_support import FakeRouter, ServerThread

from cluster.client import ClientTls, DuetClient, DuetError
from duet_wire.v1 import client_pb2 as pb
from duet_wire.v1 import client_pb2_grpc as pb_grpc
from worker.kv_transfer.tls import TlsConfig

pytestmark = pytest.mark.timeout(60)
RPC_TIMEOUT_S = 10.0
TOKEN = "frontend-token-0123456789"
OTHER_TOKEN = "second-accepted-token-abcdef"


@pytest.fixture(scope="module")
def served():
    with ServerThread(FakeRouter(), tokens=[TOKEN, OTHER_TOKEN]) as server:
        with grpc.insecure_channel(server.target) as channel:
            yield server, pb_grpc.DuetStub(channel), channel


def _status_with(stub, metadata) -> tuple[grpc.StatusCode, str]:
    try:
        stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=RPC_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Basic dXNlcjpwYXNz"),),
        (("authorization", "Bearer"),),
        (("authorization", "Bearer "),),
        (("authorization", TOKEN),),
        (("authorization", f"Bearer {TOKEN} extra"),),
        (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")),
    ],
    ids=["missing", "basic", "no-token", "empty-token", "no-scheme", "two-words", "twice"],
)
def test_missing_or_malformed_credentials_are_unauthenticated(served, metadata) -> None:
    _, stub, _ = served
    code, details = _status_with(stub, metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details


def test_a_wrong_token_is_unauthenticated(served) -> None:
    # As the HTTP front end's 401: a token that is not accepted is a failed authentication.
    _, stub, _ = served
    code, details = _status_with(stub, (("authorization", "Bearer not-the-right-token-000"),))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token not accepted" in details
    assert _status_with(stub, (("authorization", f"Bearer {TOKEN[:-1]}"),))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_every_configured_token_is_accepted_and_the_scheme_is_case_insensitive(served) -> None:
    _, stub, _ = served
    assert _status_with(stub, (("authorization", f"Bearer {TOKEN}"),))[0] == grpc.StatusCode.OK
    assert _status_with(stub, (("authorization", f"Bearer {OTHER_TOKEN}"),))[0] == grpc.StatusCode.OK
    assert _status_with(stub, (("authorization", f"bearer {TOKEN}"),))[0] == grpc.StatusCode.OK


def test_refused_calls_never_reach_the_router_even_with_a_bad_body(served) -> None:
    server, stub, channel = served
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(text="hello"), timeout=RPC_TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    raw = channel.unary_stream("/duet_wire.v1.Duet/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as raised:
        list(raw(b"\xff\xff\xff", timeout=RPC_TIMEOUT_S, metadata=(("authorization", "Bearer wrong-token-0000000000"),)))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED  # auth before parsing
    with pytest.raises(grpc.RpcError) as raised:
        stub.Abort(pb.AbortRequest(request=pb.RequestRef(request_id="req-1")), timeout=RPC_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.router.submitted == [] and server.router.aborts == [] and server.router.tokenized == []


def test_the_client_sends_its_token(served) -> None:
    server, _, _ = served
    with DuetClient(server.target, token=TOKEN) as client:
        assert client.complete("hello").text == "Hi!"
    with DuetClient(server.target, token="a-token-the-server-does-not-know") as client:
        with pytest.raises(DuetError) as raised:
            client.complete("hello")
        assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_is_exempt_and_reflection_is_not(served) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    server, _, channel = served
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    with DuetClient(server.target) as client:  # no token
        assert client.health()
    with pytest.raises(grpc.RpcError) as raised:
        ProtoReflectionDescriptorDatabase(channel).get_services()
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs():
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def sign(subject: str, key, issuer: x509.Name, issuer_key, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = sign("duet test CA", ca_key, name("duet test CA"), ca_key, ca=True)
    leaves = {}
    for leaf in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        leaves[leaf] = (pem(sign(leaf, key, ca.subject, ca_key, ca=False)), key_pem(key))
    return {"ca": pem(ca), **leaves}


def test_server_tls_with_a_ca_verified_client(certs) -> None:
    server_tls = TlsConfig(certs["server"][0], certs["server"][1], certs["ca"], require_client_auth=False)
    with ServerThread(FakeRouter(), tls=server_tls) as server:
        target = f"localhost:{server.port}"
        with DuetClient(target, tls=ClientTls(root_certificates_pem=certs["ca"])) as client:
            assert client.complete("hello").text == "Hi!"
            assert client.health()
        with DuetClient(target, timeout_s=2.0) as plain:  # no TLS: the handshake fails
            with pytest.raises(DuetError) as raised:
                plain.cluster_status()
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(certs) -> None:
    server_tls = TlsConfig(certs["server"][0], certs["server"][1], certs["ca"], require_client_auth=True)
    with ServerThread(FakeRouter(), tls=server_tls) as server:
        target = f"localhost:{server.port}"
        client_tls = TlsConfig(certs["client"][0], certs["client"][1], certs["ca"])  # the worker's type works too
        with DuetClient(target, tls=client_tls) as client:
            assert client.complete("hello").finish_reason == "length"
        with DuetClient(target, tls=ClientTls(root_certificates_pem=certs["ca"]), timeout_s=2.0) as anonymous:
            with pytest.raises(DuetError) as raised:
                anonymous.cluster_status()
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE
