"""What the `duet` subcommands share: exit statuses, CliError, the front end connection flags
(target, token, TLS) and the client built from them, the embedded-cluster flags and the
ClusterConfig built from them, logging, and running a handler with the CLI's error handling.

Exit status: 0 success, 1 an internal or unknown error, 2 a bad command line, and for calls that
end with a gRPC status, one code per class (`EXIT_CODES`): 3 invalid request, 4 authentication,
5 front end unreachable or nothing can serve, 6 deadline exceeded, 7 overloaded, 8 not found,
9 cancelled or aborted; 130 interrupted (Ctrl-C). `duet chaos` adds its own (cluster/cli/chaos.py).
Commands that deploy a cluster (serve, demo, an embedded bench) fail before starting with one code
per kind of startup problem (`STARTUP_EXIT_CODES`): 10 a configuration file that is not YAML, 11 an
invalid configuration, 12 a missing or broken model directory, 13 an unreadable file (TLS), 14 a
port in use, 15 a deployment that failed after it started.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.client import ClientConfigError, ClientTls, DuetClient, DuetError
from cluster.deploy.config import ClusterConfig, ConfigSyntaxError
from cluster.deploy.preflight import StartupError, StartupProblem
from cluster.router.config import ConfigError
from worker.protocol import InstanceRole

DEFAULT_PORT = 50051
DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"
TOKEN_ENV = "DUET_TOKEN"

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# gRPC status name -> exit status.
EXIT_CODES: dict[str, int] = {
    "INVALID_ARGUMENT": 3,
    "OUT_OF_RANGE": 3,
    "FAILED_PRECONDITION": 3,
    "ALREADY_EXISTS": 3,
    "UNAUTHENTICATED": 4,
    "PERMISSION_DENIED": 4,
    "UNAVAILABLE": 5,
    "DEADLINE_EXCEEDED": 6,
    "RESOURCE_EXHAUSTED": 7,
    "NOT_FOUND": 8,
    "CANCELLED": 9,
    "ABORTED": 9,
}

STARTUP_EXIT_CODES: dict[StartupProblem, int] = {
    StartupProblem.CONFIG_SYNTAX: 10,
    StartupProblem.CONFIG: 11,
    StartupProblem.MODEL: 12,
    StartupProblem.FILE: 13,
    StartupProblem.PORT: 14,
    StartupProblem.DEPLOYMENT: 15,
}

Handler = Callable[[argparse.Namespace], int]
AddParser = Callable[[argparse._SubParsersAction], None]


class CliError(Exception):
    """An expected failure with a one-line message and an exit status (never a traceback)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def startup_failure(error: StartupError) -> CliError:
    return CliError(str(error), STARTUP_EXIT_CODES[error.kind])


def run_handler(handler: Handler, args: argparse.Namespace, prog: str) -> int:
    """Run a subcommand's handler: a CliError is one line on stderr ("PROG: message") and its exit
    status, Ctrl-C is 130, a reader that left the pipe (`duet generate ... | head`) is not an error.
    Any other exception is a bug or an unexpected environment: one line too, and exit status 1; its
    traceback only with `--log-level DEBUG`, where it is what the user asked for."""
    try:
        return handler(args)
    except (CliError, StartupError) as error:
        failure = startup_failure(error) if isinstance(error, StartupError) else error
        print(f"{prog}: {failure}", file=sys.stderr)
        return failure.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as error:  # noqa: BLE001 - the CLI's last word on an unexpected failure
        if getattr(args, "log_level", "INFO") == "DEBUG":
            raise
        detail = _first_line(str(error)) if str(error).strip() else ""
        what = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
        print(f"{prog}: unexpected error: {what} (--log-level DEBUG shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level(parser: argparse._ActionsContainer, default: str) -> None:
    parser.add_argument(
        "--log-level", default=default, choices=LOG_LEVELS,
        help="log to stderr from this level on; DEBUG also shows the traceback of an unexpected error",
    )


def add_old_spelling(parser: argparse._ActionsContainer, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """`old`, an earlier spelling of `new`, still accepted for one release and hidden from --help."""
    parser.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


class HelpFormatter(argparse.HelpFormatter):
    """--help shows every flag's default: appended where the help text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings and "default" not in text and "(" not in text
            and default not in (None, False, argparse.SUPPRESS, [], ())
        ):
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text = f"{text} (default: {shown})" if text else f"(default: {shown})"
        return text


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


# ---- the front end connection -----------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionWording:
    """How a subcommand's --help words the connection flags (the flags themselves are the same)."""

    target_default: str | None = DEFAULT_TARGET
    target_help: str = f"the gRPC front end (default {DEFAULT_TARGET})"
    tls_ca_help: str = "use TLS; verify the front end with this CA (PEM)"
    tls_cert_help: str = "client certificate chain for mutual TLS (PEM)"
    tls_key_help: str = "client private key for mutual TLS (PEM)"


def add_connection_options(group: argparse._ActionsContainer, wording: ConnectionWording = ConnectionWording()) -> None:
    """--target, --token, --tls-*: how to reach the gRPC front end."""
    group.add_argument(
        "--target", default=wording.target_default, type=with_default_port, metavar="HOST[:PORT]",
        help=f"{wording.target_help}; without a port, {DEFAULT_PORT}",
    )
    group.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV} if set)")
    group.add_argument("--tls-ca", default=None, metavar="FILE", help=wording.tls_ca_help)
    group.add_argument("--tls-cert", default=None, metavar="FILE", help=wording.tls_cert_help)
    group.add_argument("--tls-key", default=None, metavar="FILE", help=wording.tls_key_help)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """The connection flags in their own help group (generate, status), and --log-level."""
    add_connection_options(parser.add_argument_group("front end connection"))
    add_log_level(parser, "WARNING")


def with_default_port(target: str) -> str:
    """HOST:PORT from a --target; a bare host gets duet's port, where gRPC would silently take 443.
    Targets with a scheme (dns:///, unix:, ipv4:) are gRPC's business and stay as given."""
    if "://" in target or target.startswith(("unix:", "ipv4:", "ipv6:", "dns:")):
        return target
    if target.startswith("["):  # [IPv6] or [IPv6]:PORT
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    colons = target.count(":")
    if colons == 0:
        return f"{target}:{DEFAULT_PORT}"
    if colons > 1:  # a bare IPv6 address
        return f"[{target}]:{DEFAULT_PORT}"
    return target


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The token and TLS keyword arguments of a (sync or async) client, from the connection flags."""
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        try:
            tls = ClientTls(
                root_certificates_pem=_read_file(args.tls_ca, "--tls-ca"),
                certificate_chain_pem=_read_file(args.tls_cert, "--tls-cert"),
                private_key_pem=_read_file(args.tls_key, "--tls-key"),
            )
        except ClientConfigError as error:
            raise CliError(f"TLS settings: {error}", EXIT_USAGE) from None
    return {"token": token, "tls": tls}


def connect(args: argparse.Namespace, *, timeout_s: float | None = None) -> DuetClient:
    try:
        return DuetClient(args.target, timeout_s=timeout_s, **client_options(args))
    except ClientConfigError as error:
        raise CliError(str(error), EXIT_USAGE) from None


def _read_file(path: str | None, option: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise CliError(f"{option}: cannot read {path}: {error.strerror}", EXIT_USAGE) from None


def rpc_failure(error: DuetError, target: str) -> CliError:
    """One line that says what went wrong, and the exit status of its class."""
    exit_code = EXIT_CODES.get(error.code.name, EXIT_INTERNAL)
    if error.unreachable:
        reason = "connection refused" if "connection refused" in error.message.lower() else _first_line(error.message)
        return CliError(f"cannot reach the duet front end at {target} ({reason}); is `duet serve` running?", exit_code)
    return CliError(f"{error.code.name}: {_first_line(error.message)}", exit_code)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no details)"


# ---- the cluster to deploy (serve, demo, an embedded bench) -------------------------------------


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """What to deploy: a config file plus flag overrides (flags win)."""
    parser.add_argument("--config", metavar="FILE", help="cluster configuration (YAML); see cluster/deploy/config.py")
    parser.add_argument(
        "--address", metavar="ADDR", default=None,
        help="the Ray cluster to join (default: $RAY_ADDRESS, else an embedded local cluster)",
    )
    parser.add_argument("--model", metavar="DIR", default=None, help="a local Hugging Face checkpoint (default: the built-in tiny model)")
    parser.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
        help="model and KV dtype (default: the configuration's dtype, auto: a checkpoint's own on CPU)",
    )
    parser.add_argument("--device", default=None, metavar="DEV", help="auto, cpu or cuda (default: the configuration's device, auto)")
    for role in ("prefill", "generation", "mixed"):
        parser.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"number of {role.upper()} instances (default: the configuration's, 1 PREFILL + 1 GENERATION)")
    add_log_level(parser, "INFO")


def load_cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The --config file (or the defaults) with the flags that are set laid over it."""
    try:
        config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
        counts = {
            role: getattr(args, role.value.lower())
            for role in InstanceRole
            if getattr(args, role.value.lower(), None) is not None
        }
        if counts:
            config = config.with_instances(counts)
        overrides: dict[str, Any] = {}
        for name in ("model", "dtype", "device"):
            value = getattr(args, name, None)
            if value is not None:
                overrides[name] = value
        if getattr(args, "address", None):
            overrides["ray"] = dataclasses.replace(config.ray, address=args.address)
        frontend = {}
        if getattr(args, "host", None) is not None:
            frontend["host"] = args.host
        if getattr(args, "port", None) is not None:
            frontend["port"] = args.port
        if getattr(args, "auth_token", None):
            frontend["tokens"] = tuple(args.auth_token)
        for name in ("http_port", "served_model_name", "chat_template"):
            if getattr(args, name, None) is not None:
                frontend[name] = getattr(args, name)
        if getattr(args, "metrics_port", None) is not None:
            frontend["metrics_port"] = args.metrics_port
        engine = {
            key: getattr(args, flag)
            for flag, key in (("max_model_len", "max_seq_len"), ("gpu_memory_utilization", "gpu_memory_utilization"),
                              ("stream_interval_ms", "stream_interval_ms"))
            if getattr(args, flag, None) is not None
        }
        if engine:
            overrides["engine"] = {**config.engine, **engine}
        if getattr(args, "drain_timeout", None) is not None:
            overrides["drain_timeout_s"] = args.drain_timeout
        if frontend:
            try:
                overrides["frontend"] = dataclasses.replace(config.frontend, **frontend)
            except ConfigError as error:
                raise error.under("frontend") from None
        if overrides:
            config = dataclasses.replace(config, **overrides)
    except OSError as error:
        raise startup_failure(
            StartupError(StartupProblem.CONFIG, f"cannot read the configuration: {error.strerror}", str(args.config))
        ) from None
    except ConfigError as error:
        kind = StartupProblem.CONFIG_SYNTAX if isinstance(error, ConfigSyntaxError) else StartupProblem.CONFIG
        raise startup_failure(StartupError(kind, f"bad configuration: {error.detail}", error.where)) from None
    return config


def with_free_ports(config: ClusterConfig) -> ClusterConfig:
    """The front end and its metrics on free ports, the HTTP API off: a cluster started by a
    command must not collide with a `duet serve` on the default ones."""
    return dataclasses.replace(config, frontend=dataclasses.replace(config.frontend, port=0, metrics_port=0, http_port=0))
