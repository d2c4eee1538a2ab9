"""Detached child processes with a pid file and a log file under the state directory.

A process started by ``astraflow up`` must outlive the CLI, and ``astraflow down`` (another
process) must find and stop it, so its identity lives on disk: ``<name>.pid`` holds the pid and the
process's kernel start time, which guards against stopping an unrelated process that reused the pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ProcessStartError(RuntimeError):
    """A supervised process exited or did not answer in time."""


def _start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; the fields after it are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # zombie: it has exited, only the exit status is left
        return None
    return int(fields[19])


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when its parent exits (test fixtures
    use it so that a killed pytest leaves no servers behind). libc is loaded here, in the parent:
    the hook itself only makes one system call, which is safe between fork and exec."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class SupervisedProcess:
    """One named process of the embedded stack: ``<state_dir>/<name>.pid`` and ``<name>.log``."""

    def __init__(self, name: str, state_dir: Path) -> None:
        self.name = name
        self.state_dir = Path(state_dir)
        self.pid_file = self.state_dir / f"{name}.pid"
        self.log_file = self.state_dir / "logs" / f"{name}.log"

    # -- identity ----------------------------------------------------------------------------
    def pid(self) -> int | None:
        """The pid of the running process, or None (a stale pid file is ignored)."""
        try:
            record = json.loads(self.pid_file.read_text())
        except (OSError, ValueError):
            return None
        pid, started = int(record["pid"]), record.get("start_time")
        self._reap(pid)
        now = _start_time(pid)
        if now is None or (started is not None and now != started):
            return None
        return pid

    def alive(self) -> bool:
        return self.pid() is not None

    @staticmethod
    def _reap(pid: int) -> None:
        """Collect the exit status if ``pid`` is our own child, so it does not linger as a zombie."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)

    # -- lifecycle ---------------------------------------------------------------------------
    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> int:
        """Start ``argv`` in its own session (Ctrl+C in the terminal does not reach it), output
        appended to the log file; returns the pid."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent_hook() if die_with_parent else None,  # noqa: PLW1509
            )
        record = {"pid": proc.pid, "start_time": _start_time(proc.pid), "argv": list(argv)}
        tmp = self.pid_file.with_suffix(".pid.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.pid_file)
        return proc.pid

    def wait_until(self, answers: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Poll ``answers()`` until it returns True; fail early if the process dies. Returns the
        seconds waited."""
        start = time.monotonic()
        delay = 0.05
        last_error: Exception | None = None
        while True:
            if not self.alive():
                raise ProcessStartError(f"{self.name} exited during start-up.\n{self.log_tail()}")
            try:
                if answers():
                    return time.monotonic() - start
            except Exception as exc:  # noqa: BLE001 - any failure means "not yet"; reported on timeout
                last_error = exc
            if time.monotonic() - start > timeout_s:
                raise ProcessStartError(
                    f"{self.name} did not answer as {what} within {timeout_s:.0f} s "
                    f"(last error: {last_error!r}).\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL after ``timeout_s``. Returns True if a process was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.05)
        if self.pid() is not None:
            self._signal(pid, signal.SIGKILL)
            while self.pid() is not None:
                time.sleep(0.02)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL now, leaving the pid file (as a crash would)."""
        pid = self.pid()
        if pid is not None:
            self._signal(pid, signal.SIGKILL)
            while self.pid() is not None:
                time.sleep(0.02)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        # The child leads its own session and process group: signal the group so that helper
        # processes it may have forked go too.
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_file})"
        return f"last lines of {self.log_file}:\n" + "\n".join(text)
