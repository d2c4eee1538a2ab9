"""TensorBoard event files through tensorboardX (the ``tensorboard`` extra)."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.config import ConfigError
from astraflow.report.sinks.config import TensorBoardSinkConfig


class TensorBoardSink:
    def __init__(self, config: TensorBoardSinkConfig, run: str) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("report.tensorboard needs tensorboardX: pip install 'astraflow[tensorboard]'") from None
        self.logdir = Path(config.dir) / run
        self.writer = SummaryWriter(logdir=str(self.logdir), flush_secs=int(max(1, config.flush_s)))

    def write(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time or time.time())

    def flush(self) -> None:
        pass  # the writer flushes every flush_s

    def close(self) -> None:
        self.writer.close()
