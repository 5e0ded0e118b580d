"""What `duet serve` checks before it starts Ray: everything that can be known from this machine.

A mistake found here costs a second; found by an instance actor or the front end, it costs a whole
deployment (20-35 s of Ray and model loading) and arrives as a remote traceback. Each check raises
a `StartupError` with what is wrong, where, and its kind; the CLI prints it as one line and exits
with the kind's status (cluster/cli/common.py, `STARTUP_EXIT_CODES`).

    check_before_start(config)     # model files, TLS files, ports; StartupError on the first problem

The configuration itself was validated when it was loaded (cluster/deploy/config.py). Nothing here
imports torch or ray.
"""

from __future__ import annotations

import enum
import errno
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cluster.deploy.config import ClusterConfig

# The weight files worker/loader.py reads (it imports torch, so its constants are not imported here).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class StartupProblem(enum.Enum):
    """The kinds of startup failure; each has its own exit status."""

    CONFIG_SYNTAX = "config_syntax"
    CONFIG = "config"
    MODEL = "model"
    FILE = "file"
    PORT = "port"
    DEPLOYMENT = "deployment"


class StartupError(Exception):
    """One startup problem: `what` is wrong at `where` (a path, a file, HOST:PORT)."""

    def __init__(self, kind: StartupProblem, what: str, where: str) -> None:
        super().__init__(f"{what} ({where})")
        self.kind = kind
        self.what = what
        self.where = where


@dataclass(frozen=True)
class PortToBind:
    setting: str  # the configuration key that chose it ("frontend.port")
    host: str
    port: int


def ports_to_bind(config: ClusterConfig) -> list[PortToBind]:
    """Every fixed TCP port the serving process binds (0 and None bind nothing fixed)."""
    frontend = config.frontend
    ports = [PortToBind("frontend.port", frontend.host, frontend.port)]
    if frontend.metrics_port is not None:
        ports.append(PortToBind("frontend.metrics_port", frontend.host, frontend.metrics_port))
    if frontend.http_port:
        ports.append(PortToBind("frontend.http_port", frontend.host, frontend.http_port))
    return [port for port in ports if port.port != 0]


def check_before_start(config: ClusterConfig) -> None:
    if config.model is not None:
        check_model_directory(config.model)
    for setting in ("tls_cert", "tls_key", "tls_client_ca"):
        file = getattr(config.frontend, setting)
        if file is not None:
            check_readable(file, f"frontend.{setting}")
    for setting in ("tls_certificate_chain", "tls_private_key", "tls_root_certificates"):
        file = config.kv_transfer.get(setting)
        if file is not None:
            check_readable(file, f"kv_transfer.{setting}")
    check_ports(ports_to_bind(config))


# Ray's job supervisor SIGKILLs a stopped job this long after its SIGTERM unless the job's runtime
# environment sets RAY_JOB_STOP_WAIT_TIME_S (the supervisor reads it there, not from duet).
RAY_JOB_STOP_WAIT_DEFAULT_S = 3


def drain_warning(config: ClusterConfig, environ: Mapping[str, str]) -> str | None:
    """Under `ray job submit`, a warning when `ray job stop` would kill the drain part way."""
    if "RAY_JOB_ID" not in environ and "RAY_JOB_CONFIG_JSON_ENV_VAR" not in environ:
        return None
    raw = environ.get("RAY_JOB_STOP_WAIT_TIME_S")
    try:
        wait_s = int(raw) if raw is not None else RAY_JOB_STOP_WAIT_DEFAULT_S
    except ValueError:
        return f"RAY_JOB_STOP_WAIT_TIME_S={raw!r} is not a whole number of seconds"
    if wait_s > config.drain_timeout_s:
        return None
    return (
        f"`ray job stop` kills this job {wait_s} s after SIGTERM, before the {config.drain_timeout_s:g} s drain "
        "can end: submit with --runtime-env-json '{\"env_vars\": {\"RAY_JOB_STOP_WAIT_TIME_S\": \"<more>\"}}'"
    )


def check_model_directory(model: str) -> None:
    """The checkpoint directory has a valid config.json, a tokenizer.json and safetensors weights."""
    from worker.model_config import ModelConfig, ModelConfigError

    directory = Path(model)
    if not directory.is_dir():
        raise StartupError(StartupProblem.MODEL, "model directory not found", model)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise StartupError(StartupProblem.MODEL, "the model has no config.json", str(config_file))
    try:
        import json

        raw = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        ModelConfig.from_hf_config(raw)
    except (OSError, ValueError) as error:
        detail = str(error) if isinstance(error, ModelConfigError) else f"unreadable: {error}"
        raise StartupError(StartupProblem.MODEL, f"bad model config.json: {detail}", str(config_file)) from None
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise StartupError(StartupProblem.MODEL, "the model has no tokenizer.json", str(tokenizer_file))
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise StartupError(StartupProblem.MODEL, f"the model has no weights ({' or '.join(WEIGHT_FILES)})", model)


def check_readable(file: str, setting: str) -> None:
    try:
        with open(file, "rb"):
            pass
    except OSError as error:
        raise StartupError(StartupProblem.FILE, f"cannot read {setting}: {error.strerror}", file) from None


def check_ports(ports: list[PortToBind]) -> None:
    """Bind each port once and let it go: the servers themselves bind only once the deployment is
    up, tens of seconds later. A port taken in between still fails there, reported the same way."""
    seen: dict[int, str] = {}
    for item in ports:
        where = f"{item.host}:{item.port}, {item.setting}"
        if item.port in seen:
            raise StartupError(StartupProblem.PORT, f"port also chosen by {seen[item.port]}", where)
        seen[item.port] = item.setting
        try:
            infos = socket.getaddrinfo(item.host, item.port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise StartupError(StartupProblem.PORT, f"cannot resolve the host: {error.strerror}", where) from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            # As the servers do: a port whose last connection lingers in TIME_WAIT is free to them.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                what = "port already in use" if error.errno == errno.EADDRINUSE else f"cannot bind: {error.strerror}"
                raise StartupError(StartupProblem.PORT, what, where) from None
