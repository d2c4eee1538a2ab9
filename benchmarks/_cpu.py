"""CPU seconds of a benchmark's child processes (the components and the embedded servers), by role.

Sampled from ``/proc`` (Linux) on a background thread, so a figure for any window of the run can be
read afterwards: ``between(t0, t1)`` with wall-clock times such as the trainer's step records carry.
Elsewhere there is no ``/proc``: ``available`` is False and every figure is empty.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Self

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
COMPONENTS = ("trainer", "raas", "dataflow", "archive")
"""``astraflow`` subcommands a launched component runs as (its role)."""
SERVERS = {"tansu": "tansu", "weed": "seaweedfs"}
"""Executable name -> role of the embedded stack's servers."""


def role_of(argv: list[str]) -> str:
    """The role of a process from its command line: a component, a server, or ``other``."""
    exe = Path(argv[0]).name if argv else ""
    for name, role in SERVERS.items():
        if name in exe:
            return role
    if "astraflow.cli.main" in argv:
        for arg in argv[argv.index("astraflow.cli.main") + 1:]:
            if arg in COMPONENTS:
                return arg
    return "other"


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for d in PROC.glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(d.name))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu_s(pid: int) -> tuple[float, str] | None:
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    # fields[0] is the state (stat's 3rd field): utime and stime are stat's 14th and 15th
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S, role_of([a for a in argv if a])


class ProcessCpu:
    """Samples every descendant of this process every ``every_s`` seconds while started."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.available = (PROC / str(os.getpid()) / "stat").exists()
        self._samples: list[tuple[float, dict[int, tuple[float, str]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Self:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            sample = {pid: got for pid in _descendants(os.getpid()) if (got := _cpu_s(pid)) is not None}
            self._samples.append((now, sample))
            self._stop.wait(self.every_s)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per role from the first sample at or after ``t0`` to the last at or before
        ``t1``; a process that started in between counts from its first sample."""
        inside = [s for s in self._samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        first: dict[int, float] = {}
        for _, sample in inside:
            for pid, (cpu, _role) in sample.items():
                first.setdefault(pid, cpu)
        last: dict[int, tuple[float, str]] = {}
        for _, sample in inside:
            last.update(sample)
        out: dict[str, float] = {}
        for pid, (cpu, role) in last.items():
            out[role] = out.get(role, 0.0) + cpu - first[pid]
        return out
