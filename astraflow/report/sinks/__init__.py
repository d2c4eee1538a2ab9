"""Metrics sinks fed from ``<run>.metrics`` (:mod:`astraflow.report.sinks.consumer`)."""

from astraflow.report.sinks.config import ReportConfig, TensorBoardSinkConfig

__all__ = ["ReportConfig", "TensorBoardSinkConfig"]
