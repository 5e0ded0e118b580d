"""`duet serve`: start (or join) a Ray cluster, deploy the instances, serve the gRPC client API
and the OpenAI-compatible HTTP API until SIGTERM / Ctrl-C, then drain (cluster/deploy/serve.py does the work).

    duet serve --config cluster.yaml           # or: ray job submit --working-dir . -- duet serve ...
"""

from __future__ import annotations

import argparse
import asyncio

from cluster.cli.common import add_cluster_options, load_cluster_config, setup_logging


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="deploy instances on Ray and serve the gRPC client API",
        description="Start (or join) a Ray cluster, deploy the instances, serve the client API until "
        "SIGTERM / Ctrl-C, then drain. Logs 'serving on HOST:PORT' when ready.",
    )
    add_cluster_options(parser)
    parser.add_argument("--host", default=None, help="front end bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="front end port (default 50051; 0 picks a free one)")
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
        "--auth-token", action="append", default=[], metavar="TOKEN",
        help="require this bearer token from clients (repeatable)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # The router/deploy stack is imported when a command deploys, so that every `duet` start stays fast.
    from cluster.deploy.serve import serve

    setup_logging(args.log_level)
    config = load_cluster_config(args)

    def announce(line: str) -> None:
        print(line, flush=True)

    return asyncio.run(serve(config, announce=announce))
