"""The `duet` command line: one module per subcommand, the shared parts in cluster/cli/main.py."""
