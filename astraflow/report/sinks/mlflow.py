"""MLflow metrics through mlflow-skinny (the ``mlflow`` extra): one MLflow run per AstraFlow run, found
again by name when the consumer restarts."""

from __future__ import annotations

import os
import time

from astraflow.config import ConfigError
from astraflow.report.sinks.config import MLflowSinkConfig


class MLflowSink:
    def __init__(self, config: MLflowSinkConfig, run: str) -> None:
        if config.tracking_uri.startswith("file:") or "://" not in config.tracking_uri:
            # MLflow 3 refuses its file store unless told it is wanted: the local store is the point here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("report.mlflow needs mlflow-skinny: pip install 'astraflow[mlflow]'") from None
        self.client = MlflowClient(tracking_uri=config.tracking_uri)
        experiment = self.client.get_experiment_by_name(config.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(config.experiment))
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{run}'",
                                        max_results=1)
        self.run_id = found[0].info.run_id if found else self.client.create_run(experiment_id, run_name=run).info.run_id

    def write(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        self.client.log_metric(self.run_id, tag, value, timestamp=int(1000 * (wall_time or time.time())), step=step)

    def flush(self) -> None:
        pass  # each metric is logged as it comes

    def close(self) -> None:
        pass  # the run stays open: a resumed run, or a restarted consumer, writes on into it
