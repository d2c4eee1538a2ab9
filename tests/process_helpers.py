"""Process checks shared by the tests that start and stop real processes."""

from __future__ import annotations

from pathlib import Path

from astraflow.process import child_processes as children  # noqa: F401 (the tests' name)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the command name, which may itself contain ") ".
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
