"""`duet serve`: start (or join) a Ray cluster, deploy the instances, serve the gRPC client API
and the OpenAI-compatible HTTP API until SIGTERM / Ctrl-C, then drain (cluster/deploy/serve.py does the work).

    duet serve --config cluster.yaml           # or: ray job submit --working-dir . -- duet serve ...
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from cluster.cli.common import add_cluster_options, add_old_spelling, load_cluster_config, setup_logging


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="deploy instances on Ray and serve the gRPC client API",
        description="Start (or join) a Ray cluster, deploy the instances, serve the client API until "
        "SIGTERM / Ctrl-C, then drain. Logs 'serving on HOST:PORT' when ready.",
    )
    add_cluster_options(parser)
    parser.add_argument("--host", default=None, help="front end bind address (default: frontend.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="front end port (default: frontend.port, 50051; 0 picks a free one)")
    parser.add_argument(
        "--http-port", type=int, default=None, metavar="PORT",
        help="port of the OpenAI-compatible HTTP API on the same host (default 8000; 0 turns it off)",
    )
    parser.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model name the HTTP API answers to (default: the checkpoint directory's name, or duet-default)",
    )
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template that overrides the checkpoint's (HTTP chat completions)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT",
        help="Prometheus /metrics port (default: frontend.metrics_port, 9464; 0 picks a free one)",
    )
    parser.add_argument(
        "--token", dest="auth_token", action="append", default=[], metavar="TOKEN",
        help="accept this bearer token from clients (repeatable; at least 16 characters; default: no authentication)",
    )
    add_old_spelling(parser, "--auth-token", "--token", "auth_token", action="append")
    parser.add_argument(
        "--max-model-len", type=int, default=None, metavar="TOKENS",
        help="the engine's maximum sequence length, prompt + output (default: engine.max_seq_len, else the model's context)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="F",
        help="the share of its GPU an instance fills when nothing sizes its KV pool (default: engine.gpu_memory_utilization, 0.9)",
    )
    parser.add_argument(
        "--stream-interval-ms", type=float, default=None, metavar="MS",
        help="instances report a request's tokens in groups of up to MS; first and last tokens at once "
        "(default: engine.stream_interval_ms, 0: every step)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=None, metavar="SECONDS",
        help="seconds in-flight requests get to finish on SIGTERM (default: drain_timeout_s, 30)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # The router/deploy stack is imported when a command deploys, so that every `duet` start stays fast.
    from cluster.deploy.preflight import check_before_start, drain_warning
    from cluster.deploy.serve import serve

    setup_logging(args.log_level)
    config = load_cluster_config(args)
    # Before Ray: a mistake found here is one line in a second, not a traceback after a deployment.
    check_before_start(config)
    warning = drain_warning(config, os.environ)
    if warning:
        logging.getLogger("cluster.cli.serve").warning("%s", warning)

    def announce(line: str) -> None:
        print(line, flush=True)

    return asyncio.run(serve(config, announce=announce))
