"""Which task records a node may commit: a record is done when every task row in it finished
(its trajectories acknowledged by the broker, or the workflow rejected it).

A task record can hold several Task rows; the record's offset is handed to
:meth:`LogConsumer.commit` only once all of them are done. ``LogConsumer`` itself then commits only
the contiguous processed prefix per partition, so a slow task at offset 5 holds back the commit of
offsets 6, 7, ... that finished earlier: a SIGKILL re-delivers 5, 6, 7 (duplicates are fine, the
dataflow dedups by episode id), never skips 5.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

M = TypeVar("M")


class InFlightTasks(Generic[M]):
    """Task records handed to episodes and not yet finished."""

    def __init__(self) -> None:
        self._remaining: dict[int, list[Any]] = {}  # id(record) -> [record, rows left]

    def add(self, record: M, rows: int) -> None:
        """``record`` was polled and carries ``rows`` tasks (0 rows: done at once)."""
        self._remaining[id(record)] = [record, rows]

    def task_done(self, record: M) -> M | None:
        """One task of ``record`` finished; returns the record when it was the last one."""
        entry = self._remaining.get(id(record))
        if entry is None:
            raise KeyError("task_done for a record that is not in flight")
        entry[1] -= 1
        if entry[1] <= 0:
            del self._remaining[id(record)]
            return entry[0]
        return None

    def __len__(self) -> int:
        return len(self._remaining)

    @property
    def tasks(self) -> int:
        """Task rows not finished yet."""
        return sum(e[1] for e in self._remaining.values())
