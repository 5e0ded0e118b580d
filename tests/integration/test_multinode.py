"""Placement across several (logical) Ray nodes with role labels, and resource checks that fail fast.

ray.cluster_utils.Cluster starts a head and two worker nodes on 127.0.0.1; custom resources label
them as the prefill node and the generation node, and the deployment pins each role by label.
"""

from __future__ import annotations

import time

import pytest
from cluster_harness import ClusterHarness  # noqa: I001 - a test helper beside this file

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
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"prefill_node": 1})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"generation_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    try:
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
