"""``metrics.jsonl``: one JSON object per metrics record, in the order the launcher read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self


class MetricsLog:
    """Appends metrics records to ``path`` (line-buffered: a crash loses at most the last line)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.count = 0

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self.count += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``; a torn last line (crash mid-write) is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
