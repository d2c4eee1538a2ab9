"""The run's component processes: started as separate sessions, watched, stopped without leftovers.

Each child leads its own session and process group, so Ctrl+C in the terminal reaches only the
launcher, which then stops the children in order (SIGTERM to each group, SIGKILL after a grace
period). Children also get ``PR_SET_PDEATHSIG``: if the launcher itself is SIGKILLed, the kernel
terminates them instead of leaving orphans that keep consuming tasks.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.process import log_tail, spawn_logged, terminate_groups


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


class ChildExited(RuntimeError):
    """A component process ended while the run still needed it."""

    def __init__(self, name: str, returncode: int, log_path: Path, tail: str) -> None:
        self.name, self.returncode, self.log_path = name, returncode, log_path
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
        super().__init__(f"component {name!r} {how} unexpectedly; its log is {log_path}\n{tail}")


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.spec.name

    def returncode(self) -> int | None:
        return self.proc.poll()


class ProcessGroup:
    """The children of one run. Not thread-safe: drive it from the launcher's main loop."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self.stopping = False

    def start(self, spec: ChildSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"a component named {spec.name!r} already runs")
        proc = spawn_logged(spec.argv, spec.log_path, env=spec.env, die_with_parent=True)
        child = Child(spec, proc)
        self.children[spec.name] = child
        return child

    def check(self) -> list[str]:
        """Names of children that finished cleanly (``may_exit`` and status 0). Raises
        :class:`ChildExited` for the first child that ended otherwise."""
        finished = []
        for child in self.children.values():
            rc = child.returncode()
            if rc is None:
                continue
            if rc == 0 and child.spec.may_exit:
                finished.append(child.name)
                continue
            if not self.stopping:
                raise ChildExited(child.name, rc, child.spec.log_path, log_tail(child.spec.log_path))
        return finished

    def alive(self) -> list[str]:
        return [c.name for c in self.children.values() if c.returncode() is None]

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.values()}

    def stop(self, grace_s: float | None = None) -> dict[str, int]:
        """SIGTERM every live child's process group, SIGKILL what is left after the grace period,
        reap everything. Returns each child's exit status."""
        self.stopping = True
        grace = self.grace_s if grace_s is None else grace_s
        procs = {c.proc.pid: c.proc for c in self.children.values()}
        # Signal the group even when the leader is gone: a helper it forked may still run.
        terminate_groups(list(procs), lambda pid: procs[pid].poll() is None, grace, kill_leaderless=True)
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        return {c.name: c.proc.returncode for c in self.children.values()}

