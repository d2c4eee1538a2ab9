"""Process checks shared by the tests that start and stop real processes."""

from __future__ import annotations

from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the command name, which may itself contain ") ".
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> dict[int, list[str]]:
    """The live child processes of ``pid``: pid -> argv (scans ``/proc``; no psutil here)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry.name)] = [a.decode(errors="replace") for a in argv if a]
    return out
