"""The `duet` command line.

    duet generate "Once upon a time" --max-tokens 32 --temperature 0
    echo "prompt from stdin" | duet generate - --json
    duet status --watch 2
    duet serve --config cluster.yaml           # or: ray job submit --working-dir . -- duet serve ...
    duet demo

`--target HOST:PORT` (default 127.0.0.1:50051) is the gRPC front end; `--address` is always the
Ray cluster's (DESIGN.md §4). Each subcommand lives in a `_add_<name>(subparsers)` function that
builds its parser and sets `handler`; adding one is adding a function to `SUBCOMMANDS`.

Exit status: 0 success, 1 an internal or unknown error, 2 a bad command line, and for calls that
end with a gRPC status, one code per class (`EXIT_CODES`): 3 invalid request, 4 authentication,
5 front end unreachable or nothing can serve, 6 deadline exceeded, 7 overloaded, 8 not found,
9 cancelled or aborted; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # pragma: no cover
    from cluster.client import ClusterStatus, DuetClient, DuetError

DEFAULT_TARGET = "127.0.0.1:50051"
TOKEN_ENV = "DUET_TOKEN"

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# gRPC status name -> exit status (names, so that grpc is imported only when a command runs).
EXIT_CODES: dict[str, int] = {
    "INVALID_ARGUMENT": 3,
    "OUT_OF_RANGE": 3,
    "FAILED_PRECONDITION": 3,
    "UNAUTHENTICATED": 4,
    "PERMISSION_DENIED": 4,
    "UNAVAILABLE": 5,
    "DEADLINE_EXCEEDED": 6,
    "RESOURCE_EXHAUSTED": 7,
    "NOT_FOUND": 8,
    "CANCELLED": 9,
    "ABORTED": 9,
}

Handler = Callable[[argparse.Namespace], int]


class CliError(Exception):
    """An expected failure with a one-line message and an exit status (never a traceback)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---- shared options ---------------------------------------------------------------------------


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """--target, --token, --tls-*: how to reach the gRPC front end."""
    group = parser.add_argument_group("front end connection")
    group.add_argument(
        "--target", default=DEFAULT_TARGET, metavar="HOST:PORT", help=f"the gRPC front end (default {DEFAULT_TARGET})"
    )
    group.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV} if set)")
    group.add_argument("--tls-ca", default=None, metavar="FILE", help="use TLS; verify the front end with this CA (PEM)")
    group.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate chain for mutual TLS (PEM)")
    group.add_argument("--tls-key", default=None, metavar="FILE", help="client private key for mutual TLS (PEM)")


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The token and TLS keyword arguments of a (sync or async) client, from the connection flags."""
    from cluster.client import ClientConfigError, ClientTls

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
    from cluster.client import ClientConfigError, DuetClient

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


# ---- duet generate ----------------------------------------------------------------------------


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a completion from the cluster, streamed to stdout",
        description="Stream a completion to stdout; a one-line summary goes to stderr.",
    )
    parser.add_argument("prompt", metavar="PROMPT", help='the prompt text ("-" reads it from stdin)')
    parser.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate at most (16)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T", help="0 is greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P")
    parser.add_argument("--top-k", type=int, default=None, metavar="K")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="the same seed gives the same tokens")
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="end the request after S seconds")
    parser.add_argument("--json", action="store_true", help="print each response message as one JSON object per line")
    add_target_options(parser)
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from cluster.client import ClientConfigError, DuetError, build_generate_request

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        request = build_generate_request(
            prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
        )
    except ClientConfigError as error:
        raise CliError(str(error), EXIT_USAGE) from None
    with connect(args) as client:
        try:
            if args.json:
                _generate_json(client, request, sys.stdout)
            else:
                _generate_text(client, request, sys.stdout, sys.stderr)
        except DuetError as error:
            raise rpc_failure(error, args.target) from None
    return EXIT_OK


def _generate_json(client: DuetClient, request: Any, out: TextIO) -> None:
    from google.protobuf.json_format import MessageToDict

    for response in client.generate_raw(request):
        out.write(json.dumps(MessageToDict(response), separators=(",", ":")) + "\n")
        out.flush()


def _generate_text(client: DuetClient, request: Any, out: TextIO, err: TextIO) -> None:
    from cluster.client import Delta

    started_s = time.monotonic()
    first_token_s: float | None = None
    wrote_text = False
    result = None
    try:
        for event in client.generate_request(request):
            if not isinstance(event, Delta):
                result = event  # always the last event
                continue
            if event.token_ids and first_token_s is None:
                first_token_s = time.monotonic() - started_s
            if event.text:
                out.write(event.text)
                out.flush()
                wrote_text = True
    finally:
        if wrote_text:
            out.write("\n")
            out.flush()
    total_s = time.monotonic() - started_s
    assert result is not None, "generate_request ends with a Result or raises"
    ttft = f"{first_token_s:.3f}s" if first_token_s is not None else "-"
    stop = f" ({result.stop_reason!r})" if result.stop_reason is not None else ""
    err.write(
        f"[{result.request_id}] finish={result.finish_reason or '-'}{stop} "
        f"tokens={result.usage.completion_tokens} prompt={result.usage.prompt_tokens} "
        f"cached={result.usage.cached_tokens} ttft={ttft} total={total_s:.3f}s\n"
    )
    err.flush()


# ---- duet status ------------------------------------------------------------------------------


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the cluster's instances, load, queue and request counts",
        description="A table of instances and the router's queue, request counts and recovery settings.",
    )
    parser.add_argument("--json", action="store_true", help="print the ClusterStatusResponse as JSON")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")
    add_target_options(parser)
    parser.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from cluster.client import DuetError, cluster_status_from_proto

    if args.watch is not None and not args.watch > 0:
        raise CliError("--watch: must be a positive number of seconds", EXIT_USAGE)
    if args.count is not None and args.count < 1:
        raise CliError("--count: must be >= 1", EXIT_USAGE)
    with connect(args) as client:
        if args.watch is None:
            try:
                response = client.cluster_status_raw()
            except DuetError as error:
                raise rpc_failure(error, args.target) from None
            sys.stdout.write(_status_json(response) if args.json else render_status(cluster_status_from_proto(response)))
            return EXIT_OK
        return _watch(client, args)


def _status_json(response: Any) -> str:
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(response), indent=2) + "\n"


def _watch(client: DuetClient, args: argparse.Namespace) -> int:
    """Redraw in place on a terminal; elsewhere (pipes, tests) print one frame after another.
    An unreachable front end is shown in the frame and retried: a monitor outlives restarts."""
    from cluster.client import DuetError, cluster_status_from_proto

    live = sys.stdout.isatty()
    frames = 0
    while True:
        try:
            response = client.cluster_status_raw()
            frame = _status_json(response) if args.json else render_status(cluster_status_from_proto(response))
        except DuetError as error:
            frame = rpc_failure(error, args.target).args[0] + "\n"
        header = f"every {args.watch:g}s: {args.target}  {time.strftime('%H:%M:%S')}\n\n"
        sys.stdout.write(("\x1b[H\x1b[2J" if live else "") + (header if not args.json else "") + frame)
        if not live:
            sys.stdout.write("\n")
        sys.stdout.flush()
        frames += 1
        if args.count is not None and frames >= args.count:
            return EXIT_OK
        time.sleep(args.watch)


def render_status(status: ClusterStatus) -> str:
    """The human table of `duet status`."""
    header = ("INSTANCE", "ROLE", "HEALTH", "FREE/TOTAL", "CACHED", "QUEUED", "RUNNING", "XFERS", "REPORTED", "ADDRESS")
    rows = [
        (
            i.instance_id,
            i.role,
            i.health,
            f"{i.free_blocks}/{i.total_blocks}",
            str(i.cached_blocks),
            str(i.queued_requests),
            str(i.running_requests),
            str(i.active_transfers),
            _age(status.timestamp_s, i.last_report_s),
            i.address,
        )
        for i in status.instances
    ]
    lines = []
    if rows:
        widths = [max(len(row[col]) for row in (header, *rows)) for col in range(len(header))]
        for row in (header, *rows):
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    else:
        lines.append("no instances registered")
    lines.append("")
    lines.append(f"queue depth: {status.queue_depth}")
    lines.append(f"requests by state: {_counts(status.requests_by_state)}")
    lines.append(f"requests by outcome: {_counts(status.requests_by_outcome)}")
    lines.append(f"placement: {status.placement_policy or '-'}")
    fallbacks = " -> ".join(status.fallbacks) if status.fallbacks else "-"
    lines.append(f"transfer recovery: {fallbacks} (at most {status.max_recovery_attempts} attempts)")
    return "\n".join(lines) + "\n"


def _age(now_s: float, then_s: float | None) -> str:
    if then_s is None:
        return "never"
    # Both times come from the router's clock, so no skew between this machine and the cluster.
    return f"{max(0.0, now_s - then_s):.1f}s ago"


def _counts(counts: Any) -> str:
    return ", ".join(f"{name}={count}" for name, count in counts.items()) if counts else "-"


# ---- the parser -------------------------------------------------------------------------------

def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """What to deploy: a config file plus flag overrides (flags win)."""
    parser.add_argument("--config", metavar="FILE", help="cluster configuration (YAML); see cluster/deploy_config.py")
    parser.add_argument(
        "--address", metavar="ADDR", default=None,
        help="the Ray cluster to join (default: $RAY_ADDRESS, else an embedded local cluster)",
    )
    parser.add_argument("--model", metavar="DIR", default=None, help="a local Hugging Face checkpoint (default: the built-in tiny model)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--device", default=None, metavar="DEV", help="auto, cpu or cuda")
    for role in ("prefill", "generation", "mixed"):
        parser.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"number of {role.upper()} instances")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def load_cluster_config(args: argparse.Namespace) -> Any:
    from cluster.deploy.config import ClusterConfig
    from cluster.router.config import ConfigError
    from worker.engine_types import InstanceRole

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
            import dataclasses

            overrides["ray"] = dataclasses.replace(config.ray, address=args.address)
        frontend = {}
        if getattr(args, "host", None) is not None:
            frontend["host"] = args.host
        if getattr(args, "port", None) is not None:
            frontend["port"] = args.port
        if getattr(args, "auth_token", None):
            frontend["tokens"] = tuple(args.auth_token)
        if frontend:
            import dataclasses

            overrides["frontend"] = dataclasses.replace(config.frontend, **frontend)
        if overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
    except (OSError, ConfigError) as error:
        raise CliError(f"bad configuration: {error}", EXIT_USAGE) from None
    return config


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="deploy instances on Ray and serve the gRPC client API",
        description="Start (or join) a Ray cluster, deploy the instances, serve the client API until "
        "SIGTERM / Ctrl-C, then drain. Logs 'serving on HOST:PORT' when ready.",
    )
    _add_cluster_options(parser)
    parser.add_argument("--host", default=None, help="front end bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="front end port (default 50051; 0 picks a free one)")
    parser.add_argument(
        "--auth-token", action="append", default=[], metavar="TOKEN",
        help="require this bearer token from clients (repeatable)",
    )
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from cluster.deploy.serve import serve

    _setup_logging(args.log_level)
    config = load_cluster_config(args)

    def announce(line: str) -> None:
        print(line, flush=True)

    return asyncio.run(serve(config, announce=announce))


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="start the embedded cluster, stream a mixed batch of requests, print per-request timings",
        description="The quick-start job: an embedded cluster (1 PREFILL + 1 GENERATION, the built-in "
        "model), a mixed batch of requests through the client API, a table per request (TTFT, TPOT, "
        "instances used, state timeline), then shutdown.",
    )
    _add_cluster_options(parser)
    parser.set_defaults(handler=_run_demo, log_level="WARNING")


def _run_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from cluster.cli.demo import run_demo

    _setup_logging(args.log_level)
    config = load_cluster_config(args)
    config = dataclasses.replace(config, frontend=dataclasses.replace(config.frontend, port=0, metrics_port=0))
    return run_demo(config)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from cluster.cli.bench import add_bench

    add_bench(subparsers)


def _add_chaos(subparsers: argparse._SubParsersAction) -> None:
    from cluster.cli.chaos import add_chaos

    add_chaos(subparsers)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_generate,
    _add_status,
    _add_serve,
    _add_demo,
    _add_bench,
    _add_chaos,
)


def build_parser(subcommands: Sequence[Callable[[argparse._SubParsersAction], None]] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving on Ray")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in subcommands:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(version("duet-serve"))
        return EXIT_OK
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    try:
        return handler(args)
    except CliError as error:
        print(f"duet {args.command}: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `duet generate ... | head`: the reader left; not an error of ours.
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    # `python -m cluster.cli`: run the imported module's main, not this __main__ copy's, so that the
    # subcommand modules (which import cluster.cli) raise the CliError class main() catches.
    from cluster.cli.main import main as _main

    sys.exit(_main())
