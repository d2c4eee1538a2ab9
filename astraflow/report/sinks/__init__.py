"""Metrics sinks fed from ``<run>.metrics`` (:mod:`astraflow.report.sinks.consumer`)."""

from astraflow.report.sinks.config import (
    MLflowSinkConfig,
    ReportConfig,
    TensorBoardSinkConfig,
    WandbSinkConfig,
)

__all__ = ["MLflowSinkConfig", "ReportConfig", "TensorBoardSinkConfig", "WandbSinkConfig"]
