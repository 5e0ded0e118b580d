"""Shared bits of the benchmarks: the result envelope (docs/architecture.md, "Benchmarks") and table
printing."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    value: float
    target: float
    higher_is_better: bool

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def emit_result(bench: str, figures: dict[str, Any], targets: dict[str, Target]) -> None:
    """The very last stdout line: one JSON object (docs/architecture.md, "Benchmarks")."""
    print(
        json.dumps(
            {
                "bench": bench,
                "figures": figures,
                "targets": {
                    name: {"value": round(t.value, 4), "target": t.target, "met": t.met} for name, t in targets.items()
                },
            },
            sort_keys=True,
        ),
        flush=True,
    )
