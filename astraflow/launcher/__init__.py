"""``astraflow run``: a recipe's components as supervised processes, with live progress and a report."""

from astraflow.launcher.cluster import RunCluster, open_cluster, open_run_cluster
from astraflow.launcher.restarts import RestartPolicy
from astraflow.launcher.runner import RunOptions, RunResult, launch
from astraflow.launcher.supervisor import ChildExited, ChildSpec, ProcessGroup

__all__ = ["ChildExited", "ChildSpec", "ProcessGroup", "RestartPolicy", "RunCluster", "RunOptions", "RunResult",
           "launch", "open_cluster", "open_run_cluster"]
