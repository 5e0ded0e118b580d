"""The chaos soak as a benchmark: the same run, table and JSON line as `duet chaos`.

    python bench/chaos_soak.py                       # 1,000 requests (the full run)
    python bench/chaos_soak.py --quick               # a few dozen requests, more faults, 2 kills (CI smoke)
    python bench/chaos_soak.py --requests 300 --seed 3 --json-out soak.json

Progress on stderr; the report table on stdout and, as the very last stdout line, the JSON object of
docs/architecture.md, "Benchmarks": {"bench": "chaos_soak", "figures": {...}, "targets": {lost,
leaked_blocks, token_mismatches, illegal_transitions: target 0}}. Exit status 0 only when all four
are 0. Every other flag is `duet chaos`'s (cluster/cli/chaos.py); flags given after --quick win.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.cli.chaos import main  # noqa: E402

# A few dozen requests with a higher fault rate, so that a short run still sees faults and kills.
QUICK_ARGS = ("--requests", "40", "--fault-rate", "0.25", "--kill-every", "15", "--concurrency", "6")


def run(argv: list[str]) -> int:
    if "--quick" in argv:
        argv = [*QUICK_ARGS, *(arg for arg in argv if arg != "--quick")]
    return main(argv, prog="bench/chaos_soak.py")


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
