"""The `duet` command line: one module per subcommand (each with `add_parser` and `run`), the
shared parts in cluster/cli/common.py, the top-level parser and dispatch in cluster/cli/main.py."""
