"""A kill schedule for a long run (benchmarks/long_run.py): SIGKILL or SIGSTOP/SIGCONT of every component
kind of an ``astraflow run``, the embedded broker and S3 server included, at trainer steps.

Schedule: ``STEP:KIND[:SIGNAL[:SECONDS]],...``; KIND one of :data:`KINDS`, SIGNAL ``kill`` (SIGKILL, the
default: the launcher's supervisor restarts the victim) or ``stop`` (SIGSTOP, then SIGCONT after
SECONDS, default 10: a process that hangs and comes back). :func:`spread` makes an even schedule over a
run: every kind with both signals, in turn. A kill fires once a trainer step record at or above its STEP
is out AND the previous one has been recovered from (:class:`KillDriver`). The victim is its process
group where it leads one (a component's torch threads, Tansu's and SeaweedFS's children), else its pid.

Outage window of a kill: from the signal to its recovery, the first trainer step record above the
highest step recorded before the signal, written after the victim's restart (SIGKILL: its supervisor
``restart`` record) or SIGCONT. ``s_per_step`` excluding outages counts only the steps whose interval
(previous step record -> this one) overlaps no window.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from astraflow.process import child_processes
from astraflow.records.control import ControlRecord, SupervisorEvent, TrainerStep

KINDS = ("raas", "dataflow", "trainer", "archive", "tansu", "seaweedfs")
SERVERS = ("tansu", "seaweedfs")
SUPERVISOR_NAME = {"raas": "raas-default-0", "dataflow": "dataflow", "trainer": "trainer-policy",
                   "archive": "archive", "tansu": "tansu", "seaweedfs": "seaweedfs"}
"""The name the launcher's supervisor records give each kind (the math recipe: one node, policy ``policy``)."""


def victim_pid(state_dir: Path, launcher_pid: int, kind: str) -> int | None:
    """The process to signal for ``kind``: a server's from its pid file in the stack's ``state_dir``, a
    component's the one child of the launcher whose command line names it (``None``: none running now,
    or not exactly one, e.g. between a death and its restart)."""
    if kind in SERVERS:
        try:
            return int(json.loads((state_dir / f"{kind}.pid").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    pids = [pid for pid, argv in child_processes(launcher_pid).items() if kind in argv]
    return pids[0] if len(pids) == 1 else None


@dataclass
class Kill:
    step: int
    """Fires at the first trainer step record at or above this one."""
    kind: str
    signal: str = "kill"
    """``kill`` (SIGKILL) or ``stop`` (SIGSTOP, SIGCONT after ``hold_s``)."""
    hold_s: float = 10.0
    pid: int | None = None
    fired_step: int | None = None
    """The highest step recorded when it fired."""
    fired_at: float | None = None
    resumed_at: float | None = None
    """SIGCONT sent (stop) or the supervisor's restart record's time (kill)."""
    recovered_at: float | None = None
    """The first step record above ``fired_step`` after ``resumed_at``."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("resumed_at", "recovered_at"):
            out[key.replace("_at", "_s")] = (round(out.pop(key) - self.fired_at, 2)
                                             if out[key] is not None and self.fired_at else None)
        out.pop("fired_at")
        return out


def parse(text: str) -> list[Kill]:
    kills = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        step, kind, *rest = item.split(":")
        sig = rest[0] if rest else "kill"
        if kind not in KINDS or sig not in ("kill", "stop"):
            raise SystemExit(f"bad kill {item!r}: STEP:KIND[:kill|stop[:SECONDS]], KIND one of {', '.join(KINDS)}")
        kills.append(Kill(int(step), kind, sig, float(rest[1]) if len(rest) > 1 else 10.0))
    return sorted(kills, key=lambda k: k.step)


def spread(n: int, steps: int, hold_s: float = 10.0) -> list[Kill]:
    """``n`` kills evenly from 5 % to 90 % of ``steps``: the kinds in turn, SIGKILL in the first pass over
    them, SIGSTOP in the second, and so on (12 kills: every kind with both signals)."""
    if n <= 0:
        return []
    first, last = max(1, steps // 20), max(2, steps * 9 // 10)
    at = [first + round(i * (last - first) / max(1, n - 1)) for i in range(n)]
    return [Kill(step, KINDS[i % len(KINDS)], ("kill", "stop")[(i // len(KINDS)) % 2], hold_s)
            for i, step in enumerate(at)]


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid and pid != os.getpgrp():
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


class KillDriver:
    """Fires the schedule from the benchmark's poll loop (:meth:`poll`, never blocks)."""

    def __init__(self, launcher_pid: int, state_dir: Any, schedule: list[Kill]) -> None:
        self.launcher_pid, self.state_dir = launcher_pid, state_dir
        self.todo, self.done = list(schedule), []
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()

    def _settle(self, last: Kill, records: list[ControlRecord]) -> None:
        if last.resumed_at is None and last.signal == "kill":
            name = SUPERVISOR_NAME[last.kind]
            last.resumed_at = min((r.time for r in records if isinstance(r, SupervisorEvent) and r.component == name
                                   and r.event == "restart" and r.time >= (last.fired_at or 0)), default=None)
        if last.resumed_at is not None and last.recovered_at is None:  # a stop: set by its SIGCONT
            last.recovered_at = min((r.time for r in records if isinstance(r, TrainerStep)
                                     and r.step > (last.fired_step or 0) and r.time > last.resumed_at), default=None)

    def _resume(self, kill: Kill) -> None:
        """SIGCONT a stopped victim, once (a timer's thread and :meth:`finish` may both try)."""
        with self._lock:
            if kill.resumed_at is None:
                _signal(kill.pid or 0, signal.SIGCONT)
                kill.resumed_at = time.time()

    def poll(self, step: int, records: list[ControlRecord]) -> None:
        if self.done:
            self._settle(self.done[-1], records)
            if self.done[-1].recovered_at is None:
                return
        if not self.todo or step < self.todo[0].step:
            return
        kill = self.todo[0]
        pid = victim_pid(self.state_dir, self.launcher_pid, kill.kind)
        if pid is None:
            return  # between lives: the next poll
        self.todo.pop(0)
        kill.pid, kill.fired_step, kill.fired_at = pid, step, time.time()
        _signal(pid, signal.SIGSTOP if kill.signal == "stop" else signal.SIGKILL)
        if kill.signal == "stop":
            # On a timer of its own: the poll loop may itself wait on the stopped server (a bucket listing).
            self._timers.append(threading.Timer(kill.hold_s, self._resume, (kill,)))
            self._timers[-1].start()
        self.done.append(kill)
        print(f"  kill {len(self.done):2d}: {kill.signal} {kill.kind} (pid {pid}) at step {step}", file=sys.stderr,
              flush=True)

    def finish(self, records: list[ControlRecord]) -> None:
        """SIGCONT a victim still stopped; settle the last kill's times."""
        for timer in self._timers:
            timer.cancel()
        for kill in self.done:
            if kill.signal == "stop":
                self._resume(kill)
        for kill in self.done:
            self._settle(kill, records)

    def windows(self) -> list[tuple[float, float]]:
        """Each kill's outage window (to the run's end where it never recovered)."""
        return [(k.fired_at, k.recovered_at or float("inf")) for k in self.done if k.fired_at is not None]


def s_per_step_excluding(steps: dict[int, TrainerStep], bounds: list[tuple[int, int]],
                         windows: list[tuple[float, float]]) -> tuple[list[float | None], float | None]:
    """Per tenth (``bounds``: (lo, hi] steps) and overall: the mean interval between consecutive step
    records over the steps whose interval overlaps no outage window."""
    def clean(a: float, b: float) -> bool:
        return not any(a < w1 and b > w0 for w0, w1 in windows)

    ordered = sorted(steps)
    intervals = {s: (steps[p].time, steps[s].time) for p, s in itertools.pairwise(ordered) if s == p + 1}
    per: list[float | None] = []
    for lo, hi in bounds:
        xs = [b - a for s, (a, b) in intervals.items() if lo < s <= hi and clean(a, b)]
        per.append(round(sum(xs) / len(xs), 4) if xs else None)
    xs = [b - a for a, b in intervals.values() if clean(a, b)]
    return per, (round(sum(xs) / len(xs), 4) if xs else None)
