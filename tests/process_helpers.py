"""Process checks shared by the tests that start and stop real processes."""

from __future__ import annotations

import signal
import uuid
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


def launch_ranks(fn, ranks: int, *args):
    """``fn(*args)`` on ``ranks`` processes started by torch.distributed's elastic agent (the launcher
    ``astraflow run`` uses, as a Python API); returns each rank's result by rank."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex[:8],
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    # the agent installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in this (pytest's) process and
    # leaves them: put back what was there, or later tests of signal handling see torch's
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:
        return elastic_launch(config, fn)(*args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
