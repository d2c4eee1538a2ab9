"""The recipe's ``report`` section: where a run's metrics go besides ``metrics.jsonl`` and ``report.png``.

``astraflow run`` starts one small consumer of ``<run>.metrics`` (``astraflow sinks``) when a sink is
set; it can also run on another machine against the same cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TensorBoardSinkConfig(BaseModel):
    """TensorBoard event files, written through tensorboardX (the ``tensorboard`` extra)."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = Path("runs/tensorboard")
    """Event files go under ``<dir>/<run>/`` (``tensorboard --logdir <dir>`` shows every run). A
    relative path is taken from where the consumer runs (``astraflow run``: its working directory)."""
    flush_s: float = Field(default=5.0, gt=0)
    """Seconds between flushes of the event file (TensorBoard shows what is flushed)."""


class MLflowSinkConfig(BaseModel):
    """An MLflow run per AstraFlow run, written through mlflow-skinny (the ``mlflow`` extra)."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = "file:runs/mlruns"
    """Where MLflow keeps runs: a local file store (``file:<dir>``, read by ``mlflow ui
    --backend-store-uri``; its "maintenance mode" refusal is waived for it) or a tracking server
    (``http://...``)."""
    experiment: str = "astraflow"
    """The MLflow experiment (created when missing); the MLflow run is named after the AstraFlow run."""


class WandbSinkConfig(BaseModel):
    """A W&B run per AstraFlow run, written through the ``wandb`` library (the ``wandb`` extra)."""

    model_config = ConfigDict(extra="forbid")

    project: str = "astraflow"
    """The W&B project; the W&B run is named after the AstraFlow run and has it as id (a restarted
    consumer writes on into the same run once synced)."""
    mode: Literal["offline", "online"] = "offline"
    """``offline``: files only, under ``<dir>/wandb/offline-run-*/`` (``wandb sync`` uploads them
    later), no network. ``online``: the library uploads as it goes (needs ``WANDB_API_KEY``; not
    exercised by the tests, which have no network)."""
    dir: Path = Path("runs")
    """Where W&B keeps its files (``<dir>/wandb/``). A relative path is taken from where the consumer
    runs (``astraflow run``: its working directory)."""


class ReportConfig(BaseModel):
    """The metrics sinks of a run; none by default."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: TensorBoardSinkConfig | None = None
    """Scalars per trainer step (reward, truncated fraction, lengths, KL, clip share, grad norm,
    staleness, busy share, weight sync) and the nodes' tokens/s per pool."""
    mlflow: MLflowSinkConfig | None = None
    """The same scalars as MLflow metrics (``/`` in names kept), one MLflow run per AstraFlow run."""
    wandb: WandbSinkConfig | None = None
    """The same scalars as W&B history, each plotted against ``trainer/step`` (W&B's own step only
    counts rows: a pool's rate can come after a later trainer step)."""

    @property
    def any(self) -> bool:
        """Whether a sink is set (the launcher then starts the consumer)."""
        return any(sink is not None for sink in (self.tensorboard, self.mlflow, self.wandb))
