"""The command that starts a policy's trainer as a group of ranks: torch.distributed.run (torchrun's
launcher and elastic agent) around the ordinary ``astraflow trainer`` command.

``--max-restarts 0``: the agent does not restart the workers itself. When one dies it stops the others
and exits non-zero, and whoever supervises the trainer as one component (``astraflow run``'s
supervisor, a Kubernetes controller) restarts the whole group, which resumes from its checkpoint.
One machine: ``--standalone`` (a c10d rendezvous on a free local port). Several machines: a c10d
rendezvous at ``rdzv_endpoint`` with ``nnodes`` agents, one per machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def rank_group_argv(worker_argv: Sequence[str], ranks_per_node: int, *, nnodes: int = 1,
                    rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                    monitor_interval_s: float = 0.5, python: str | None = None) -> list[str]:
    """``python -m torch.distributed.run ... --module astraflow.cli.main <worker args>``.

    ``worker_argv``: the arguments after ``astraflow`` (``--config ... trainer --recipe ...``).
    ``ranks_per_node``: workers this agent starts. ``nnodes`` > 1 needs ``rdzv_endpoint`` (host:port
    of the c10d store) and a ``rdzv_id`` shared by the group's agents."""
    if ranks_per_node < 1 or nnodes < 1:
        raise ValueError("ranks_per_node and nnodes must be >= 1")
    argv = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks_per_node),
            "--max-restarts", "0", "--monitor-interval", str(monitor_interval_s)]
    if nnodes == 1 and rdzv_endpoint is None:
        argv += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a rank group on several machines needs rdzv_endpoint (host:port)")
        argv += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                 "--rdzv-id", rdzv_id or "astraflow-trainer"]
    return [*argv, "--module", "astraflow.cli.main", *worker_argv]
