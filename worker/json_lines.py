"""An append-only JSON-lines file that several threads may write: one object a line, line-buffered,
so a reader (or a crash) sees whole lines. The router's timeline log and an instance's step log
are both one (cluster/router/observe.py TimelineLog, worker/profiler.py StepLog)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, TextIO


class JsonLinesFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one line; nothing once closed."""
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
