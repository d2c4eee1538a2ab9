"""A component's ``/metrics`` for Prometheus: the latest metrics records it sent, as gauges.

Every record a component sends to ``<run>.metrics`` (:func:`~astraflow.records.control.send_control`)
is kept, the latest per schema and writer; a scrape turns each numeric field into a gauge
``astraflow_<schema>_<field>`` (``astraflow_trainer_step_reward_mean``,
``astraflow_node_status_tokens_per_s``), labelled with the writer's ``id`` / ``node_id``, ``policy`` and
``pool`` where the record has them; a field holding numbers by name (``counters``, ``versions``) becomes
one gauge with a ``name`` label. A component without records of its own (the archiver) adds a source:
a function of figures read at each scrape. Needs ``prometheus-client`` (the ``prometheus`` extra).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from astraflow.config import ConfigError
from astraflow.records.control import SENT_RECORD_OBSERVERS, ControlRecord

if TYPE_CHECKING:
    from astraflow.config import PrometheusSettings

log = logging.getLogger(__name__)
LABELS = ("id", "node_id", "policy", "pool")
"""Record fields that become labels (when a record has them as text) instead of gauges."""


def _name(*parts: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(("astraflow", *parts)))


class RecordCollector:
    """The gauges of the latest records per (schema, writer) and of the added sources."""

    def __init__(self, component: str) -> None:
        self.component = component
        self._latest: dict[tuple[str, str], ControlRecord] = {}
        self._sources: dict[str, Callable[[], dict[str, float]]] = {}
        self._lock = threading.Lock()

    def observe(self, record: ControlRecord) -> None:
        doc = record.model_dump(include=set(LABELS))
        writer = str(doc.get("id") or doc.get("node_id") or "")
        with self._lock:
            self._latest[(record.SCHEMA_NAME, writer)] = record

    def add_source(self, name: str, figures: Callable[[], dict[str, float]]) -> None:
        """Gauges ``astraflow_<name>_<figure>`` read from ``figures()`` at each scrape."""
        with self._lock:
            self._sources[name] = figures

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, labels: dict[str, str], value: float, doc: str) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), float(value))

        with self._lock:
            latest = list(self._latest.values())
            sources = list(self._sources.items())
        for record in latest:
            schema = record.SCHEMA_NAME
            doc = record.model_dump()
            labels = {"component": self.component,
                      **{k: doc[k] for k in LABELS if isinstance(doc.get(k), str)}}
            for field, value in doc.items():
                if field in LABELS:
                    continue
                if isinstance(value, int | float):
                    gauge(_name(schema, field), labels, value, f"{schema} record: {field}")
                elif isinstance(value, dict) and value and all(isinstance(v, int | float) for v in value.values()):
                    for key, v in value.items():
                        gauge(_name(schema, field), {**labels, "name": str(key)}, v, f"{schema} record: {field}")
        for name, figures in sources:
            for field, value in figures().items():
                if isinstance(value, int | float):
                    gauge(_name(name, field), {"component": self.component}, value, f"{name}: {field}")
        yield from families.values()


def serve_prometheus(settings: PrometheusSettings, component: str) -> RecordCollector | None:
    """Serve ``/metrics`` on ``settings.port`` (None when it is 0: off) from a background thread, fed
    every control record this process sends from now on."""
    if not settings.port:
        return None
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError("prometheus.port is set but prometheus-client is not installed: "
                          "pip install 'astraflow[prometheus]'") from None
    collector = RecordCollector(component)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start_http_server(settings.port, addr=settings.host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve Prometheus metrics on {settings.host}:{settings.port}: {exc}") from None
    SENT_RECORD_OBSERVERS.append(collector.observe)
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", component, settings.host, settings.port)
    return collector
