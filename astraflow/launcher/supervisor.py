"""The run's component processes: started as separate sessions, watched, stopped without leftovers.

Each child leads its own session and process group, so Ctrl+C in the terminal reaches only the
launcher, which then stops the children in order (SIGTERM to each group, SIGKILL after a grace
period). Children also get ``PR_SET_PDEATHSIG``: if the launcher itself is SIGKILLed, the kernel
terminates them instead of leaving orphans that keep consuming tasks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Set PR_SET_PDEATHSIG, then exec the real command (the setting survives execve). Done in a tiny
# exec wrapper rather than ``preexec_fn``: the launcher already runs Kafka client and torch threads
# when it forks, and running Python code between fork and exec is unsafe then.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)  # the launcher died before prctl took effect\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


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


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"--- last {len(text)} lines of {path} ---\n" + "\n".join(text)


class ProcessGroup:
    """The children of one run. Not thread-safe: drive it from the launcher's main loop."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self.stopping = False

    def start(self, spec: ChildSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"a component named {spec.name!r} already runs")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(spec.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *spec.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=spec.env,
                start_new_session=True,
            )
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
        for child in self.children.values():
            if child.returncode() is None:
                _signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        for child in self.children.values():
            # Signal the group even when the leader is gone: a helper it forked may still run.
            _signal_group(child.proc.pid, signal.SIGKILL)
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        return {c.name: c.proc.returncode for c in self.children.values()}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
