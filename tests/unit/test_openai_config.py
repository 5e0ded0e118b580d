"""The OpenAI API's settings: frontend.http_port / served_model_name / chat_template in the cluster
configuration, their `duet serve` flags, and the served model's default name."""

from __future__ import annotations

import pytest

from cluster.cli.common import load_cluster_config, with_free_ports
from cluster.cli.main import build_parser
from cluster.deploy.config import ClusterConfig
from cluster.deploy.serve import served_model_name
from cluster.router.config import ConfigError


def test_defaults_and_limits() -> None:
    frontend = ClusterConfig().frontend
    assert (frontend.http_port, frontend.served_model_name, frontend.chat_template) == (8000, None, None)
    assert ClusterConfig.from_dict({"frontend": {"http_port": 0}}).frontend.http_port == 0  # off
    with pytest.raises(ConfigError, match="frontend.http_port"):
        ClusterConfig.from_dict({"frontend": {"http_port": 70000}})
    with pytest.raises(ConfigError, match="served_model_name"):
        ClusterConfig.from_dict({"frontend": {"served_model_name": " "}})
    with pytest.raises(ConfigError, match="frontend.http_prot"):
        ClusterConfig.from_dict({"frontend": {"http_prot": 1}})
    # Commands that start a cluster of their own leave the HTTP API off (no clash with a duet serve).
    assert with_free_ports(ClusterConfig()).frontend.http_port == 0


def test_serve_flags_set_them() -> None:
    args = build_parser().parse_args(
        ["serve", "--http-port", "8123", "--served-model-name", "tiny", "--chat-template", "chat.jinja"]
    )
    frontend = load_cluster_config(args).frontend
    assert (frontend.http_port, frontend.served_model_name, frontend.chat_template) == (8123, "tiny", "chat.jinja")
    assert load_cluster_config(build_parser().parse_args(["serve"])).frontend.http_port == 8000


def test_the_served_name_defaults_to_the_checkpoint_directory(tmp_path) -> None:
    checkpoint = tmp_path / "Llama-3.2-1B-Instruct"
    checkpoint.mkdir()
    assert served_model_name(None, None) == "duet-default"
    assert served_model_name(str(checkpoint) + "/", None) == "Llama-3.2-1B-Instruct"
    assert served_model_name(str(checkpoint), "mine") == "mine"
