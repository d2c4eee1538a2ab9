"""The run's component processes: started as separate sessions, watched, restarted when they die,
stopped without leftovers.

Each child leads its own session and process group, so Ctrl+C in the terminal reaches only the
launcher, which then stops the children in order (SIGTERM to each group, SIGKILL after a grace
period). Children also get ``PR_SET_PDEATHSIG``: if the launcher itself is SIGKILLed, the kernel
terminates them instead of leaving orphans that keep consuming tasks.

A child that dies is started again with the same argv (its log file gets a note and a new start
line) after the backoff of the group's :class:`~astraflow.launcher.restarts.RestartPolicy`; only an
exhausted restart budget is an error (:class:`ChildExited`). A component that finishes on its own
(``may_exit``, status 0) is done, not restarted. A child the run no longer wants (the actuator
scaling a pool down) is *retired*: SIGTERMed once, never restarted, SIGKILLed only if it outlives its
drain time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.launcher.restarts import NO_RESTART, RestartBook, RestartPolicy
from astraflow.process import log_tail, signal_group, spawn_logged, terminate_groups
from astraflow.records.control import SupervisorEvent


@dataclass
class ChildSpec:
    """One component process of a run."""

    name: str
    """Component id shown to the user and used for the log file (``trainer-policy``, ``raas-default-0``)."""
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    may_exit: bool = False
    """True for components that finish on their own (trainers): exit status 0 is then not a failure."""


def describe_exit(returncode: int | None) -> str:
    """How a process ended, in words: ``was killed by signal 9 (SIGKILL)``, ``exited with status 3``,
    or ``died`` when the status is unknown (a server of the embedded stack, known by pid file)."""
    if returncode is None:
        return "died"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ChildExited(RuntimeError):
    """A component process ended while the run still needed it, and may not be restarted again."""

    def __init__(self, name: str, returncode: int | None, log_path: Path, tail: str, *, restarts: int = 0,
                 policy: RestartPolicy = NO_RESTART) -> None:
        self.name, self.returncode, self.log_path, self.restarts = name, returncode, log_path, restarts
        budget = ""
        if policy.max_restarts:
            budget = (f" after {restarts} restarts; restart budget exhausted ({policy.max_restarts} "
                      f"restarts within {policy.window_s:.0f} s)")
        super().__init__(f"component {name!r} {describe_exit(returncode)} unexpectedly{budget}; "
                         f"its log is {log_path}\n{tail}")


def note_restart(log_path: Path, name: str, returncode: int | None, restarts: int, delay_s: float) -> None:
    """One line in the dead process's log, above the next run's start line: why it starts again."""
    with contextlib.suppress(OSError), open(log_path, "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} supervisor: {name} {describe_exit(returncode)}; "
                  f"restart {restarts} in {delay_s:.1f} s\n")


@dataclass(frozen=True)
class RestartEvent:
    """A dead component was started again: one line in the live view, one record in metrics.jsonl."""

    name: str
    returncode: int | None
    """How the previous process ended (None: unknown)."""
    restarts: int
    """Restarts of this component so far in the run, this one included."""
    backoff_s: float
    pid: int

    def record(self) -> SupervisorEvent:
        """The launcher's record of it (in ``metrics.jsonl``)."""
        return SupervisorEvent(component=self.name, event="restart", returncode=self.returncode,
                               restarts=self.restarts, backoff_s=self.backoff_s, pid=self.pid, time=time.time())


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    book: RestartBook
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    """Set while the child is dead and waits out its backoff."""
    backoff_s: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    def returncode(self) -> int | None:
        return self.proc.poll()

    def finished(self) -> bool:
        """Ended on its own, successfully: not a failure, not restarted."""
        return self.spec.may_exit and self.returncode() == 0


@dataclass
class Retiring:
    """A child taken out of the run (:meth:`ProcessGroup.retire`), until it has exited."""

    child: Child
    since: float
    kill_at: float
    """SIGKILL its group if it still runs then."""
    killed: bool = False


@dataclass(frozen=True)
class Retired:
    """A retired child has exited."""

    name: str
    returncode: int | None
    """0: it stopped cleanly (a RaaS node drained); -9: it outlived its drain time."""
    seconds: float
    """From the stop signal to the exit."""


class ProcessGroup:
    """The children of one run. Not thread-safe: drive it from the launcher's main loop.

    ``restart`` applies to every child; the default never restarts (a dead child fails at once)."""

    def __init__(self, grace_s: float = 10.0, restart: RestartPolicy = NO_RESTART) -> None:
        self.grace_s = grace_s
        self.restart = restart
        self.children: dict[str, Child] = {}
        self.retiring: dict[str, Retiring] = {}
        self.stopping = False

    def start(self, spec: ChildSpec) -> Child:
        if spec.name in self.children or spec.name in self.retiring:
            raise ValueError(f"a component named {spec.name!r} already runs")
        proc = spawn_logged(spec.argv, spec.log_path, env=spec.env, die_with_parent=True)
        child = Child(spec, proc, RestartBook(self.restart))
        self.children[spec.name] = child
        return child

    def check(self, now: float | None = None) -> list[RestartEvent]:
        """Notice dead children and restart those whose backoff is over. Returns the restarts made;
        raises :class:`ChildExited` for the first child whose restart budget is exhausted."""
        now = time.monotonic() if now is None else now
        events = []
        for child in self.children.values():
            if self.stopping:
                break
            rc = child.returncode()
            if child.restart_at is None:
                if rc is None or child.finished():
                    continue
                self._schedule_restart(child, rc, now)
            if now >= child.restart_at:
                events.append(self._restart(child, rc))
        return events

    def _schedule_restart(self, child: Child, rc: int, now: float) -> None:
        delay = child.book.on_exit(now)
        if delay is None:
            raise ChildExited(child.name, rc, child.spec.log_path, log_tail(child.spec.log_path),
                              restarts=child.book.restarts, policy=self.restart)
        # A helper the dead process forked may still hold the group (and its work): end it first.
        # The group only, never the bare pid: that may already belong to someone else.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.restart_at, child.backoff_s = now + delay, delay
        note_restart(child.spec.log_path, child.name, rc, child.book.restarts, delay)

    def _restart(self, child: Child, rc: int) -> RestartEvent:
        spec = child.spec
        child.proc = spawn_logged(spec.argv, spec.log_path, env=spec.env, die_with_parent=True)
        child.started_at, child.restart_at = time.monotonic(), None
        return RestartEvent(child.name, rc, child.book.restarts, child.backoff_s, child.proc.pid)

    def retire(self, name: str, drain_s: float, now: float | None = None) -> None:
        """Take child ``name`` out of the run for good: SIGTERM its process group now (a RaaS node
        then drains), never restart it, SIGKILL the group if it still runs after ``drain_s``.
        :meth:`reap_retired` tells when it has exited."""
        now = time.monotonic() if now is None else now
        child = self.children.pop(name)
        if child.returncode() is None:
            signal_group(child.proc.pid, signal.SIGTERM)
        self.retiring[name] = Retiring(child, since=now, kill_at=now + drain_s)

    def reap_retired(self, now: float | None = None) -> list[Retired]:
        """Retired children that have exited since the last call; SIGKILL to those past their drain time."""
        now = time.monotonic() if now is None else now
        out = []
        for name, r in list(self.retiring.items()):
            rc = r.child.returncode()
            if rc is not None:
                del self.retiring[name]
                out.append(Retired(name, rc, now - r.since))
            elif now >= r.kill_at and not r.killed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r.child.proc.pid, signal.SIGKILL)
                r.killed = True
        return out

    def finished(self) -> list[str]:
        """Names of children that finished cleanly (``may_exit`` and status 0)."""
        return [c.name for c in self.children.values() if c.finished()]

    def alive(self) -> list[str]:
        return [c.name for c in self.children.values() if c.returncode() is None]

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.values()}

    def restarts(self) -> dict[str, int]:
        """Restarts so far per child that was restarted at least once."""
        return {c.name: c.book.restarts for c in self.children.values() if c.book.restarts}

    def stop(self, grace_s: float | None = None) -> dict[str, int]:
        """SIGTERM every live child's process group, SIGKILL what is left after the grace period,
        reap everything. Returns each child's exit status. Pending restarts are dropped."""
        self.stopping = True
        grace = self.grace_s if grace_s is None else grace_s
        children = [*self.children.values(), *(r.child for r in self.retiring.values())]
        procs = {c.proc.pid: c.proc for c in children}
        # Signal the group even when the leader is gone: a helper it forked may still run.
        terminate_groups(list(procs), lambda pid: procs[pid].poll() is None, grace, kill_leaderless=True)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        return {c.name: c.proc.returncode for c in children}
