"""Start a command as the leader of a new session with its output appended to a log file, and stop
it by signalling its whole process group (helpers it forked go too): SIGTERM, then SIGKILL after a
grace period.

A child may be asked to die with its parent (``PR_SET_PDEATHSIG``): the kernel then SIGTERMs it if
the parent ends, even by SIGKILL, so no orphan keeps running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

# Set PR_SET_PDEATHSIG, then exec the real command (the setting survives execve). Done in a tiny
# exec wrapper rather than ``preexec_fn``: the parent may already run Kafka client and torch threads
# when it forks, and running Python code between fork and exec is unsafe then.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)  # the parent died before prctl took effect\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn_logged(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen:
    """Start ``argv`` in its own session (Ctrl+C in the terminal does not reach it), stdin closed,
    stdout and stderr appended to ``log_path`` after a ``--- <time> start: <argv>`` line. With
    ``die_with_parent`` the kernel SIGTERMs it when the calling process ends. The returned
    process's pid is the command's own (the wrapper execs it in place)."""
    argv = list(argv)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *argv] if die_with_parent else argv
    with open(log_path, "ab") as log:
        # A blank line between the runs of one log file.
        gap = "\n" if log.tell() > 0 else ""
        log.write(f"{gap}--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def signal_group(pid: int, sig: int, *, foreign_ok: bool = False) -> None:
    """Send ``sig`` to the process group led by ``pid``, or to ``pid`` alone if it leads none. A
    process that is gone is not an error; one that belongs to another user (its pid was reused) is
    one unless ``foreign_ok``."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        ignored = (ProcessLookupError, PermissionError) if foreign_ok else (ProcessLookupError,)
        with contextlib.suppress(*ignored):
            os.kill(pid, sig)


def terminate_groups(
    leaders: Sequence[int],
    alive: Callable[[int], bool],
    grace_s: float,
    *,
    kill_leaderless: bool = False,
) -> None:
    """SIGTERM the group of every leader that is ``alive``, wait up to ``grace_s`` for all of them
    to exit, then SIGKILL the groups whose leader still runs. Does not wait after SIGKILL.

    ``kill_leaderless``: SIGKILL every group, also those whose leader has exited (a helper it forked
    may still run). Such a pid may already belong to another user's process, so a refused signal is
    then ignored."""
    for pid in leaders:
        if alive(pid):
            signal_group(pid, signal.SIGTERM, foreign_ok=kill_leaderless)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in leaders):
        time.sleep(0.05)
    for pid in leaders:
        if kill_leaderless or alive(pid):
            signal_group(pid, signal.SIGKILL, foreign_ok=kill_leaderless)
    if kill_leaderless:
        wait_groups_gone(leaders)


def wait_groups_gone(groups: Sequence[int], timeout_s: float = 2.0) -> bool:
    """Wait until no live process (zombies aside) is left in the process ``groups``: a signal is
    delivered when its target next runs, so on a loaded machine a helper SIGKILLed a moment ago may
    still show up. True when they are gone within ``timeout_s``."""
    wanted = {str(g) for g in groups}
    deadline = time.monotonic() + timeout_s
    while any(fields[2] in wanted for _, fields in _live_processes()):  # fields: state, ppid, pgrp, ...
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file, headed by its path, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"--- last {len(text)} lines of {path} ---\n" + "\n".join(text)


def child_processes(pid: int) -> dict[int, list[str]]:
    """The live child processes of ``pid``: pid -> argv (scans ``/proc``; no psutil here)."""
    out = {}
    for entry, fields in _live_processes():
        if int(fields[1]) != pid:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        out[int(entry.name)] = [a.decode(errors="replace") for a in argv if a]
    return out


def _live_processes() -> Iterator[tuple[Path, list[str]]]:
    """(``/proc/<pid>``, its ``stat`` fields after the command name) of every process but zombies."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may itself contain ") ": split after the last one.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            yield entry, fields
