"""The dataflow: task emission, trajectory processing and batch assembly as pure stream-processor
logic (:class:`Dataflow`), plus the process that wires it to the log (``service``)."""

from astraflow.dataflow.autoscaler import AutoscaleConfig, autoscale_report, target_nodes
from astraflow.dataflow.batcher import BatchAssembler
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.emitter import TaskEmitter
from astraflow.dataflow.pipeline import Dataflow
from astraflow.dataflow.plugins.group import Group
from astraflow.dataflow.processor import GroupResult, TrajectoryProcessor

__all__ = [
    "AutoscaleConfig",
    "BatchAssembler",
    "Dataflow",
    "DataflowConfig",
    "Group",
    "GroupResult",
    "TaskEmitter",
    "TrajectoryProcessor",
    "autoscale_report",
    "target_nodes",
]
