"""``astraflow sinks``: one consumer of ``<run>.metrics`` that feeds the recipe's ``report`` sinks.

It reads in a group of its own (``<run>.sinks``) from the topic's start, so a restarted consumer, or one
started later on another machine, writes the whole run; a sink that sees a step again overwrites it
(TensorBoard shows the last value of a step). On stop it reads what is left, then closes its sinks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from astraflow.config import ClusterConfig
from astraflow.records.control import is_control, parse_control
from astraflow.report.sinks.config import ReportConfig
from astraflow.report.sinks.scalars import ScalarFolder

log = logging.getLogger(__name__)
JOIN_ALLOWANCE_S = 30.0
"""Before its first record the consumer waits at least this long (joining the group takes seconds)."""


@dataclass
class SinkStats:
    records: int = 0
    scalars: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"records": self.records, "scalars": self.scalars}


def run_sinks(cfg: ClusterConfig, report: ReportConfig, stop: threading.Event, *,
              idle_exit_s: float | None = None, stats: SinkStats | None = None) -> SinkStats:
    """Feed every sink of ``report`` from ``<cfg.run>.metrics`` until ``stop`` (then drain) or, with
    ``idle_exit_s``, until nothing came for that long."""
    import time

    from astraflow.log import LogConsumer, Topics
    from astraflow.records.control import METRICS_TOPIC_SCHEMAS

    stats = stats or SinkStats()
    sinks = []
    if report.tensorboard is not None:
        from astraflow.report.sinks.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(report.tensorboard, cfg.run))
    if report.mlflow is not None:
        from astraflow.report.sinks.mlflow import MLflowSink

        sinks.append(MLflowSink(report.mlflow, cfg.run))
    if report.wandb is not None:
        from astraflow.report.sinks.wandb import WandbSink

        sinks.append(WandbSink(report.wandb, cfg.run))
    topic = Topics(cfg.run).metrics
    consumer = LogConsumer(cfg, topic, f"{cfg.run}.sinks", {topic: METRICS_TOPIC_SCHEMAS},
                           auto_offset_reset="earliest", client_id=f"sinks-{cfg.run}", background=True)
    folder = ScalarFolder()
    last = time.monotonic()
    patience = None if idle_exit_s is None else max(idle_exit_s, JOIN_ALLOWANCE_S)  # until the first record
    try:
        while True:
            stopping = stop.is_set()
            batch = consumer.poll(timeout_s=0.5, max_records=1000)
            for msg in batch:
                stats.records += 1
                if not is_control(msg.schema_name, msg.schema_version):
                    continue
                record = parse_control(msg.schema_name, msg.schema_version, msg.obj)
                for tag, value, step in folder.scalars(record):
                    for sink in sinks:
                        sink.write(tag, value, step, getattr(record, "time", None))
                    stats.scalars += 1
            if batch:
                for sink in sinks:
                    sink.flush()
                consumer.commit(batch)
                last, patience = time.monotonic(), idle_exit_s
            elif stopping or (patience is not None and time.monotonic() - last > patience):
                break  # stopped (and drained), or idle
        for tag, value, step in folder.flush():
            for sink in sinks:
                sink.write(tag, value, step)
            stats.scalars += 1
    finally:
        for sink in sinks:
            sink.close()
        consumer.close()
    return stats
