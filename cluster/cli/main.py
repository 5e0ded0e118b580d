"""The `duet` command line: the top-level parser, built from one module per subcommand, and the
dispatch to the chosen subcommand's handler.

    duet generate "Once upon a time" --max-tokens 32 --temperature 0
    echo "prompt from stdin" | duet generate - --json
    duet status --watch 2
    duet serve --config cluster.yaml           # or: ray job submit --working-dir . -- duet serve ...
    duet demo
    duet bench --quick
    duet chaos --requests 300
    duet sim --instances 64P,192G --profile roofline:h100-sxm:llama-3-8b --rate 2500
    duet plan --instances 8 --slo-ttft-ms 300 --slo-tpot-ms 30
    duet profile --out cpu.json

`--target HOST:PORT` (default 127.0.0.1:50051) is the gRPC front end; `--address` is always the
Ray cluster's. Each subcommand is a module of cluster/cli with `add_parser(subparsers)`, which
builds its parser and sets `handler`, and `run(args) -> int`; adding one is adding its
`add_parser` to `SUBCOMMANDS`. Exit statuses: cluster/cli/common.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version

from cluster.cli import bench, chaos, demo, generate, plan, profile, serve, sim, status
from cluster.cli.common import EXIT_OK, AddParser, Handler, HelpFormatter, run_handler

SUBCOMMANDS: tuple[AddParser, ...] = (
    generate.add_parser,
    status.add_parser,
    serve.add_parser,
    demo.add_parser,
    bench.add_parser,
    chaos.add_parser,
    profile.add_parser,
    sim.add_parser,
    plan.add_parser,
)


def build_parser(subcommands: Sequence[AddParser] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving on Ray")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    # Every subcommand's --help shows each flag's default (common.HelpFormatter).
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in subcommands:
        add(subparsers)
    return parser


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(version("duet-serve"))
        return EXIT_OK
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    return run_handler(handler, args, f"duet {args.command}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
