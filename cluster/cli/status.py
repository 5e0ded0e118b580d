"""`duet status`: the cluster's instances, loads, queue and request counts, once or live.

    duet status
    duet status --json
    duet status --watch 2          # redraws every 2 s until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from google.protobuf.json_format import MessageToDict

from cluster.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_target_options,
    connect,
    rpc_failure,
    setup_logging,
)
from cluster.client import ClusterStatus, DuetClient, DuetError, cluster_status_from_proto


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the cluster's instances, load, queue and request counts",
        description="A table of instances and the router's queue, request counts and recovery settings.",
    )
    parser.add_argument("--json", action="store_true", help="print the ClusterStatusResponse as JSON")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")
    add_target_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
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
    return json.dumps(MessageToDict(response), indent=2) + "\n"


def _watch(client: DuetClient, args: argparse.Namespace) -> int:
    """Redraw in place on a terminal; elsewhere (pipes, tests) print one frame after another.
    An unreachable front end is shown in the frame and retried: a monitor outlives restarts."""
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
    header = ("INSTANCE", "ROLE", "HEALTH", "KV BLOCKS FREE/TOTAL", "CACHED BLOCKS", "QUEUED", "RUNNING", "XFERS", "REPORTED", "ADDRESS")
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
    model = status.model
    if model is not None:
        lines.append(
            f"model: {model.name} ({model.architecture}, {model.dtype}, context {model.max_model_len} tokens, "
            f"KV capacity {model.kv_capacity_tokens} tokens per instance)"
        )
    lines.append(f"queue depth: {status.queue_depth}")
    lines.append(f"requests by state: {_counts(status.requests_by_state)}")
    lines.append(f"requests by outcome: {_counts(status.requests_by_outcome)}")
    lines.append(f"placement: {status.placement_policy or '-'}")
    chain = " -> ".join(status.fallbacks) if status.fallbacks else "-"
    lines.append(f"transfer recovery: {chain} (at most {status.max_recovery_attempts} attempts)")
    return "\n".join(lines) + "\n"


def _age(now_s: float, then_s: float | None) -> str:
    if then_s is None:
        return "never"
    # Both times come from the router's clock, so no skew between this machine and the cluster.
    return f"{max(0.0, now_s - then_s):.1f}s ago"


def _counts(counts: Any) -> str:
    return ", ".join(f"{name}={count}" for name, count in counts.items()) if counts else "-"
