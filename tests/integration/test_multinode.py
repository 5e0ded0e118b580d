"""Placement across several (logical) Ray nodes with role labels, and resource checks that fail fast.

ray.cluster_utils.Cluster starts a head and two worker nodes on 127.0.0.1; custom resources label
them as the prefill node and the generation node, and the deployment pins each role by label.
"""

from __future__ import annotations

import time

import pytest
from cluster_harness import ClusterHarness, start_ray  # noqa: I001 - a test helper beside this file

from cluster.deploy.config import ClusterConfig
from cluster.deploy.launch import Deployment, DeploymentError
from worker.default_model import margin_corpus


@pytest.fixture(scope="module")
def multinode():
    import os

    import ray
    from ray.cluster_utils import Cluster

    # tests/conftest.py pins Ray to 127.0.0.1 when joining a cluster (see there).
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    started: list[Cluster] = []

    def start() -> Cluster:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
        )
        started.append(cluster)
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"prefill_node": 1})
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"generation_node": 1})
        cluster.wait_for_nodes()
        return cluster

    def stop() -> None:  # what a failed try started: a node that timed out left the others running
        while started:
            started.pop().shutdown()

    cluster = start_ray(start, stop, "a head and two worker nodes")
    try:
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
        labels = {}
        for node in ray.nodes():
            for label in ("prefill_node", "generation_node"):
                if label in node["Resources"]:
                    labels[label.split("_")[0]] = node["NodeID"]
        yield ray, labels
    finally:
        ray.shutdown()
        cluster.shutdown()


def _config(**overrides) -> ClusterConfig:
    data = {
        "dtype": "float32",
        "device": "cpu",
        "instances": [
            {"role": "PREFILL", "count": 1, "num_cpus": 0.5, "resources": {"prefill_node": 0.5}},
            {"role": "GENERATION", "count": 1, "num_cpus": 0.5, "resources": {"generation_node": 0.5}},
        ],
        "engine": {"num_blocks": 256},
        "frontend": {"port": 0, "metrics_port": 0, "http_port": 0},
        "actor_start_timeout_s": 120,
    }
    data.update(overrides)
    return ClusterConfig.from_dict(data)


def test_roles_are_placed_on_their_labelled_nodes_and_serve(multinode) -> None:
    ray, nodes = multinode
    harness = ClusterHarness(_config()).start()
    try:
        infos = {iid: harness.run(client.get_info()) for iid, client in harness.cluster.deployment.clients.items()}
        where = {iid: info.node_id for iid, info in infos.items()}
        assert where == {"prefill-0": nodes["prefill"], "generation-0": nodes["generation"]}
        with harness.client(timeout_s=60) as client:
            done = client.complete(margin_corpus(0, 1)[0], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert [w.instance_id for w in done.instances] == ["prefill-0", "generation-0"]
        assert len(done.token_ids) == 8
    finally:
        harness.stop()


def test_unsatisfiable_deployment_fails_fast_naming_the_resource(multinode) -> None:
    for instances, needle in [
        ([{"role": "MIXED", "count": 1, "num_gpus": 1}], "GPU"),
        ([{"role": "MIXED", "count": 1, "resources": {"tpu_node": 1}}], "tpu_node"),
        ([{"role": "MIXED", "count": 9, "num_cpus": 1}], "CPU=9"),
    ]:
        config = _config(instances=instances, router={"placement": {"disaggregation": "never"}})
        started = time.monotonic()
        with pytest.raises(DeploymentError) as error:
            Deployment(config).start()
        assert needle in str(error.value)
        assert time.monotonic() - started < 10  # checked before any actor is created


def test_the_kv_path_between_nodes_is_mutual_tls_without_any_certificate_configured(multinode) -> None:
    import random
    import socket
    import ssl

    from cryptography import x509

    from worker.kv_layout import KvLayout
    from worker.kv_transfer.buffers import LinearKvBuffer
    from worker.kv_transfer.certificates import TRANSFER_SERVER_NAME
    from worker.kv_transfer.config import TransportSecurity
    from worker.kv_transfer.failures import FailureReason
    from worker.kv_transfer.ids import new_transfer_id
    from worker.kv_transfer.sender import KvSender

    ray, _ = multinode
    config = _config()
    assert "tls" not in config.kv_transfer  # nothing configured: the deployment makes its own CA
    harness = ClusterHarness(config).start()
    try:
        deployment = harness.cluster.deployment
        assert deployment.transfer_ca_pem is not None
        with harness.client(timeout_s=60) as client:  # prefill -> generation across nodes, over mTLS
            done = client.complete(margin_corpus(0, 1)[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [w.instance_id for w in done.instances] == ["prefill-0", "generation-0"]
        address = harness.run(deployment.clients["generation-0"].get_info()).transfer_address
        host, port = address.rsplit(":", 1)

        # The receiver speaks TLS 1.3 with a certificate of this deployment's CA, for the transfer name.
        context = ssl.create_default_context(cadata=deployment.transfer_ca_pem.decode("ascii"))
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.set_alpn_protocols(["h2"])
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=TRANSFER_SERVER_NAME) as tls:
                assert tls.version() == "TLSv1.3"
                names = [value for kind, value in tls.getpeercert()["subjectAltName"] if kind == "DNS"]
                assert names == [TRANSFER_SERVER_NAME]

        # A plaintext push, even with the cluster token, is refused before any byte of KV moves.
        layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, tokens_per_block=16, dtype="float32", model_fingerprint="m")
        source = LinearKvBuffer(layout, 1, bytearray(random.Random(5).randbytes(layout.run_bytes(1, 1))))
        with KvSender(security=TransportSecurity(token=deployment.cluster_token)) as sender:
            outcome = sender.push(address, new_transfer_id(), "plain", source, 5.0)
        assert outcome.failure is not None and outcome.failure.reason is FailureReason.PEER_UNAVAILABLE
        assert outcome.chunks_sent == 0

        # Ray restarts a killed instance from its original spec, with its predecessor's certificate;
        # the router sees the new incarnation and the deployer's CA reissues it one.
        def served_serial(address: str) -> int:
            host, port = address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                with context.wrap_socket(raw, server_hostname=TRANSFER_SERVER_NAME) as tls:
                    return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number

        before = served_serial(address)
        router = harness.router
        incarnation = harness.call(lambda: router.fleet.get("generation-0").info.incarnation)
        ray.kill(deployment.actors["generation-0"], no_restart=False)
        deadline = time.monotonic() + 90
        while True:
            member = harness.call(lambda: router.fleet.get("generation-0"))
            if member.info.incarnation != incarnation and not member.dead:
                address = member.info.transfer_address
                if served_serial(address) != before:
                    break
            assert time.monotonic() < deadline, "the restarted instance never served a reissued certificate"
            time.sleep(0.2)
        with harness.client(timeout_s=60) as client:  # and the KV path still carries a hand-over
            done = client.complete(margin_corpus(1, 1)[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [w.instance_id for w in done.instances] == ["prefill-0", "generation-0"]
    finally:
        harness.stop()
