"""W&B history through the ``wandb`` library (the ``wandb`` extra): one W&B run per AstraFlow run.

Every key is plotted against ``trainer/step`` (``define_metric``), logged in each row: W&B's own
``_step`` must only grow, and a pool's rate can arrive after a later trainer step (other partitions)
or a second policy count its steps apart. The scalars of one step go in one row.
"""

from __future__ import annotations

import os
import re

from astraflow.config import ConfigError
from astraflow.report.sinks.config import WandbSinkConfig

STEP_KEY = "trainer/step"
"""The x axis of every chart: the trainer step a scalar belongs to."""
RESERVED_IN_ID = re.compile(r"[:;,#?/'\\%\s]")
"""Characters W&B refuses in a run id (``wandb.Settings.validate_run_id``), and a backslash, percent and
whitespace, which its URLs would need escaped."""
QUIET_ENV = {"WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false", "WANDB_DISABLE_GIT": "true",
             "WANDB_DISABLE_CODE": "true"}
"""No banner on stdout, no crash reports sent, no git or code capture: the sink only writes scalars."""


class WandbSink:
    def __init__(self, config: WandbSinkConfig, run: str) -> None:
        for name, value in QUIET_ENV.items():
            os.environ.setdefault(name, value)
        os.environ["WANDB_MODE"] = config.mode  # the library reads it too; an earlier sink's must not linger
        try:
            import wandb
        except ImportError:
            raise ConfigError("report.wandb needs wandb: pip install 'astraflow[wandb]'") from None
        self.wandb = wandb
        config.dir.mkdir(parents=True, exist_ok=True)
        # console off: the consumer's stdout/stderr stay its own (no wrapping); no system metrics,
        # machine metadata (a cloud metadata request) or requirements file: nothing but the scalars.
        settings = wandb.Settings(mode=config.mode, silent=True, console="off", x_disable_stats=True,
                                  x_disable_meta=True, x_disable_machine_info=True, disable_git=True,
                                  save_code=False, x_save_requirements=False)
        try:
            self.run = wandb.init(project=config.project, name=run, id=RESERVED_IN_ID.sub("-", run),
                                  resume="allow", dir=str(config.dir), settings=settings, reinit="create_new")
        except wandb.errors.Error as exc:  # e.g. online without an API key: one line, not a traceback
            wandb.teardown()
            raise ConfigError(f"report.wandb ({config.mode}): {exc}") from None
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.row: dict[str, float] = {}

    def write(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        if self.row and (self.row[STEP_KEY] != step or tag in self.row):
            self.flush()
        self.row.setdefault(STEP_KEY, step)
        self.row[tag] = value

    def flush(self) -> None:
        """Log the row being gathered (the consumer calls this after each batch it read)."""
        if self.row:
            self.run.log(self.row)
            self.row = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()
        self.wandb.teardown()  # the wandb-core service process ends with the run
