"""What a run leaves behind: ``runs/<run>/metrics.jsonl`` (every metrics record) and ``report.png``."""

from astraflow.report.metrics import MetricsLog, load_metrics
from astraflow.report.plot import write_report

__all__ = ["MetricsLog", "load_metrics", "write_report"]
