"""`duet serve` fails before Ray starts, in one line with its own exit status, for every mistake it
can see from this machine; a failure after deployment is worded the same way."""

from __future__ import annotations

import json
import socket

import pytest
from test_frontend_support import free_port

from cluster.cli.common import STARTUP_EXIT_CODES
from cluster.cli.main import main
from cluster.deploy.launch import DeploymentError, root_cause
from cluster.deploy.preflight import StartupProblem


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything tries to start or join Ray."""
    started = []

    def refuse(config):
        started.append(config)
        raise AssertionError("Ray was started")

    monkeypatch.setattr("cluster.deploy.launch.connect_ray", refuse)
    return started


def _serve(capsys, no_ray, *argv: str) -> tuple[int, str]:
    code = main(["serve", "--port", str(free_port()), "--metrics-port", "0", "--http-port", "0", *argv])
    err = capsys.readouterr().err
    assert no_ray == [], "Ray was started"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return code, lines[0]


def _model_dir(tmp_path, *, tokenizer: bool = True, weights: bool = True):
    directory = tmp_path / "model"
    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    }
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
    if weights:
        (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, no_ray) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("instances: []\nfrontend: {port: 5\n")
    code, line = _serve(capsys, no_ray, "--config", str(config))
    assert code == STARTUP_EXIT_CODES[StartupProblem.CONFIG_SYNTAX] == 10
    assert line.startswith("duet serve: bad configuration: YAML syntax error: expected ',' or '}'")
    assert line.endswith(f"({config}:3:1)")


def test_unknown_key_names_its_path_and_the_file(tmp_path, capsys, no_ray) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("engine: {tokens_per_blok: 16}\n")
    code, line = _serve(capsys, no_ray, "--config", str(config))
    assert code == STARTUP_EXIT_CODES[StartupProblem.CONFIG] == 11
    assert line == f"duet serve: bad configuration: unknown engine option (engine.tokens_per_blok in {config})"


def test_short_token_is_a_configuration_error(tmp_path, capsys, no_ray) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("frontend: {tokens: [secret]}\n")
    code, line = _serve(capsys, no_ray, "--config", str(config))
    assert code == 11
    assert line == (
        "duet serve: bad configuration: token must be printable ASCII of at least 16 characters "
        f"(frontend.tokens[0] in {config})"
    )
    code, line = _serve(capsys, no_ray, "--token", "secret")
    assert code == 11 and line.endswith("(frontend.tokens[0])") and "secret" not in line.split("(")[0]
    config.write_text("cluster_token: short\n")
    code, line = _serve(capsys, no_ray, "--config", str(config))
    assert code == 11 and line.endswith(f"(cluster_token in {config})") and "short" not in line.split("(")[0]


def test_missing_model_directory(capsys, no_ray) -> None:
    code, line = _serve(capsys, no_ray, "--model", "/models/missing")
    assert code == STARTUP_EXIT_CODES[StartupProblem.MODEL] == 12
    assert line == "duet serve: model directory not found (/models/missing)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokenizer": False}, "the model has no tokenizer.json (MODEL/tokenizer.json)"),
        ({"weights": False}, "the model has no weights (model.safetensors or model.safetensors.index.json) (MODEL)"),
    ],
)
def test_incomplete_model_directory(tmp_path, capsys, no_ray, kwargs, message) -> None:
    directory = _model_dir(tmp_path, **kwargs)
    code, line = _serve(capsys, no_ray, "--model", str(directory))
    assert code == 12 and line == "duet serve: " + message.replace("MODEL", str(directory))


def test_model_config_json_problems(tmp_path, capsys, no_ray) -> None:
    directory = _model_dir(tmp_path)
    (directory / "config.json").unlink()
    code, line = _serve(capsys, no_ray, "--model", str(directory))
    assert code == 12 and line == f"duet serve: the model has no config.json ({directory}/config.json)"
    (directory / "config.json").write_text("{not json")
    code, line = _serve(capsys, no_ray, "--model", str(directory))
    assert code == 12 and line.startswith("duet serve: bad model config.json: unreadable:")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_port_in_use(capsys, no_ray, flag) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, line = _serve(capsys, no_ray, flag, str(port))
    setting = "frontend.port" if flag == "--port" else "frontend.metrics_port"
    assert code == STARTUP_EXIT_CODES[StartupProblem.PORT] == 14
    assert line == f"duet serve: port already in use (127.0.0.1:{port}, {setting})"


def test_same_port_twice(capsys, no_ray) -> None:
    port = free_port()
    code, line = _serve(capsys, no_ray, "--port", str(port), "--metrics-port", str(port))
    assert code == 14 and line == f"duet serve: port also chosen by frontend.port (127.0.0.1:{port}, frontend.metrics_port)"


def test_unreadable_tls_file(tmp_path, capsys, no_ray) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f"frontend: {{tls_cert: {tmp_path}/cert.pem, tls_key: {tmp_path}/key.pem}}\n")
    code, line = _serve(capsys, no_ray, "--config", str(config))
    assert code == STARTUP_EXIT_CODES[StartupProblem.FILE] == 13
    assert line == f"duet serve: cannot read frontend.tls_cert: No such file or directory ({tmp_path}/cert.pem)"


def test_deployment_failure_is_one_line(monkeypatch, capsys, no_ray) -> None:
    """A failure only the deployment can see (an instance that cannot load its model) is worded
    like the others, with the remote traceback reduced to its cause."""

    def fail(self):
        raise DeploymentError("instance failed to start: CheckpointError: shard missing", "prefill-0")

    monkeypatch.setattr("cluster.deploy.launch.Deployment.connect", lambda self: None)
    monkeypatch.setattr("cluster.deploy.launch.Deployment.start", fail)
    monkeypatch.setattr("cluster.deploy.launch.Deployment.stop", lambda self: None)
    code, line = _serve(capsys, no_ray)
    assert code == STARTUP_EXIT_CODES[StartupProblem.DEPLOYMENT] == 15
    assert line == "duet serve: instance failed to start: CheckpointError: shard missing (prefill-0)"


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch, capsys, no_ray) -> None:
    def boom(config):
        raise KeyError("surprise")

    monkeypatch.setattr("cluster.deploy.preflight.check_before_start", boom)
    code, line = _serve(capsys, no_ray)
    assert code == 1 and line == "duet serve: unexpected error: KeyError: 'surprise' (--log-level DEBUG shows the traceback)"
    with pytest.raises(KeyError):
        main(["serve", "--log-level", "DEBUG"])


def test_root_cause_of_a_ray_error() -> None:
    text = (
        "\x1b[36mray::Instance.__init__()\x1b[39m (pid=1, ip=127.0.0.1)\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
        "worker.loader.CheckpointError: /models/m: neither model.safetensors nor an index found\n"
    )
    assert root_cause(RuntimeError(text)) == "worker.loader.CheckpointError: /models/m: neither model.safetensors nor an index found"


@pytest.mark.parametrize("name", ["cluster-cpu.yaml", "cluster-gpu.yaml"])
def test_the_example_configurations_load(name) -> None:
    from pathlib import Path

    from cluster.deploy.config import ClusterConfig

    config = ClusterConfig.from_yaml(Path(__file__).resolve().parents[2] / "examples" / name)
    assert config.drain_timeout_s >= 30


def test_a_ray_job_without_stop_wait_time_is_warned() -> None:
    from cluster.deploy.config import ClusterConfig
    from cluster.deploy.preflight import drain_warning

    config = ClusterConfig(drain_timeout_s=30.0)
    assert drain_warning(config, {}) is None  # not a Ray job
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert "kills this job 3 s after SIGTERM, before the 30 s drain" in drain_warning(config, job)
    assert drain_warning(config, {**job, "RAY_JOB_STOP_WAIT_TIME_S": "45"}) is None
    assert "not a whole number" in drain_warning(config, {**job, "RAY_JOB_STOP_WAIT_TIME_S": "1.5"})


def test_serve_flags_land_in_the_configuration() -> None:
    from cluster.cli.common import load_cluster_config
    from cluster.cli.main import build_parser

    args = build_parser().parse_args(
        ["serve", "--metrics-port", "9999", "--max-model-len", "1024", "--drain-timeout", "45", "--token", "t" * 16]
    )
    config = load_cluster_config(args)
    assert config.frontend.metrics_port == 9999 and config.frontend.tokens == ("t" * 16,)
    assert config.engine["max_seq_len"] == 1024 and config.drain_timeout_s == 45.0
    assert all(config.engine_config(group).max_seq_len == 1024 for group in config.instances)
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.6", "--stream-interval-ms", "15"])
    engines = [load_cluster_config(args).engine_config(group) for group in config.instances]
    assert all((e.gpu_memory_utilization, e.stream_interval_ms, e.max_seq_len) == (0.6, 15.0, None) for e in engines)


@pytest.mark.parametrize(("flag", "value", "key"), [("--gpu-memory-utilization", "1.5", "gpu_memory_utilization"),
                                                  ("--stream-interval-ms", "-1", "stream_interval_ms")])
def test_a_bad_engine_flag_is_a_configuration_error_naming_its_key(capsys, no_ray, flag, value, key) -> None:
    code, line = _serve(capsys, no_ray, flag, value)
    assert code == 11 and line.startswith("duet serve: bad configuration:") and key in line


def test_a_bad_max_model_len_is_a_configuration_error(capsys, no_ray) -> None:
    code, line = _serve(capsys, no_ray, "--max-model-len", "0")
    assert code == 11 and line.startswith("duet serve: bad configuration:") and "max_seq_len" in line
