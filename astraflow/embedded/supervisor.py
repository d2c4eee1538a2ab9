"""Detached child processes with a pid file and a log file under the state directory.

A process started by ``astraflow up`` must outlive the CLI, and ``astraflow down`` (another
process) must find and stop it, so its identity lives on disk: ``<name>.pid`` holds the pid and the
process's kernel start time, which guards against stopping an unrelated process that reused the pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from astraflow.process import log_tail, signal_group, spawn_logged, terminate_groups


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
        appended to the log file; returns the pid. ``die_with_parent`` (test fixtures): the kernel
        stops it when the calling process ends, even by SIGKILL, so a killed pytest leaves no
        servers behind; ``astraflow up`` leaves it off, since the stack must outlive the CLI."""
        proc = spawn_logged(argv, self.log_file, env=env, cwd=cwd, die_with_parent=die_with_parent)
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
        # Only while the pid file's process (pid and start time) lives: its pid, once free, may
        # lead an unrelated group.
        terminate_groups([pid], lambda _: self.pid() is not None, timeout_s)
        while self.pid() is not None:
            time.sleep(0.02)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL now, leaving the pid file (as a crash would)."""
        pid = self.pid()
        if pid is not None:
            signal_group(pid, signal.SIGKILL)
            while self.pid() is not None:
                time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_file, lines)
