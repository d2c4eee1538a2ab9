"""``astraflow run``: a recipe's components as supervised processes, with live progress and a report."""

from astraflow.launcher.cluster import open_cluster
from astraflow.launcher.runner import RunOptions, RunResult, launch
from astraflow.launcher.supervisor import ChildExited, ChildSpec, ProcessGroup

__all__ = ["ChildExited", "ChildSpec", "ProcessGroup", "RunOptions", "RunResult", "launch", "open_cluster"]
