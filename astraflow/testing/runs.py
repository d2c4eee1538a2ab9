"""Run a recipe on a real cluster and read back what it left on the log.

For tests and benchmarks of whole runs: :func:`private_cluster` starts an embedded Tansu + SeaweedFS
stack of its own; :func:`load_recipe` loads a recipe file with overrides; :func:`run_recipe` launches
it through the real launcher (``astraflow run``'s code path: every component a separate process) and
returns a :class:`RunRecords` — the metrics records, the batches per policy, every trajectory and the
weight announcements — measured from the log, never from inside a component. :func:`trainer_steps`
and :func:`batch_index` pick the trainer's step records and a batch's index out of them.
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.records.control import ControlRecord, TrainerStep


@contextlib.contextmanager
def private_cluster(state_dir: Path | None = None) -> Iterator[Any]:
    """A resolved ClusterConfig on an embedded Tansu + SeaweedFS stack of our own (free loopback
    ports, in-memory log), stopped on exit."""
    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    with contextlib.ExitStack() as stack_ctx:
        if state_dir is None:
            state_dir = Path(stack_ctx.enter_context(tempfile.TemporaryDirectory(prefix="af-bench-")))
        stack, _ = EmbeddedStack.start_private(state_dir)
        try:
            yield ClusterConfig(state_dir=state_dir).resolve()
        finally:
            stack.down()


def load_recipe(path: str | Path, **updates: Any):
    """A recipe file with nested ``updates`` (``{"dataflow": {"mode": "sync"}}``) merged in."""
    import yaml

    from astraflow.recipe import Recipe

    path = Path(path)
    data = yaml.safe_load(path.read_text())
    _merge(data, updates)
    recipe = Recipe.model_validate(data)
    recipe.source = path.resolve()
    return recipe


def _merge(base: dict, upd: dict) -> None:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


@dataclass
class RunRecords:
    """Everything a finished run left on the log, read back."""

    run_id: str
    wall_s: float
    returncode: int
    reason: str
    metrics: list[ControlRecord]
    """The typed records of the run's ``metrics.jsonl`` (a user's untyped figures left out)."""
    batches: dict[str, list[Any]]
    """Per policy, the Batch records in order."""
    trajectories: list[Any]
    """Every trajectory the nodes produced (trained or not)."""
    announced: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Per policy, (version, announcement record timestamp)."""


def run_recipe(recipe: Any, cfg: Any, *, runs_dir: Path, label: str, timeout_s: float = 300.0,
               threads: int | None = None, run_id: str | None = None) -> RunRecords:
    """Launch ``recipe`` (``astraflow run``'s code path: every component a separate process) and read
    back its records. ``run_id``: default ``<label>-<random>``; ``threads``: torch threads per
    component, default ``astraflow run``'s (the cores divided among the trainers and nodes)."""
    from rich.console import Console

    from astraflow.launcher import RunOptions, launch

    run_id = run_id or f"{label}-{uuid.uuid4().hex[:6]}"
    console = Console(file=io.StringIO() if not sys.stderr.isatty() else sys.stderr, width=160)
    res = launch(recipe, cfg, RunOptions(run_id=run_id, runs_dir=runs_dir, live=False, timeout_s=timeout_s,
                                         grace_s=10.0, threads=threads), console=console)
    from astraflow.report import load_metrics
    from astraflow.report.plot import typed_records

    metrics = typed_records(load_metrics(res.metrics_path))
    run_cfg = cfg.model_copy(update={"run": run_id})
    policies = [p.name for p in recipe.policies]
    batches, trajs, announced = read_log(run_cfg, policies)
    if res.returncode != 0 and isinstance(console.file, io.StringIO):
        sys.stderr.write(console.file.getvalue()[-4000:])
    return RunRecords(run_id, res.wall_s, res.returncode, res.reason, metrics, batches, trajs, announced)


def read_log(cfg: Any, policies: list[str], *, idle_polls: int = 4) -> tuple[dict, list, dict]:
    """Batches per policy, all trajectories and weight announcements of a run, read with a group of
    our own from the beginning (counting records, not trusting watermarks)."""
    from astraflow.log import LogConsumer, Topics
    from astraflow.records import batch as batch_rec
    from astraflow.records import trajectory as traj_rec
    from astraflow.records.control import WeightAnnouncement

    topics = Topics(cfg.run)
    names = [topics.trajectories, *(topics.batches(p) for p in policies), *(topics.weights(p) for p in policies)]
    consumer = LogConsumer(cfg, names, group_id=f"{cfg.run}.bench.{uuid.uuid4().hex[:6]}",
                           auto_offset_reset="earliest")
    batches: dict[str, list] = {p: [] for p in policies}
    trajs: list = []
    announced: dict[str, list] = {p: [] for p in policies}
    by_batch_topic = {topics.batches(p): p for p in policies}
    by_weight_topic = {topics.weights(p): p for p in policies}
    empty = 0
    deadline = time.monotonic() + 120
    try:
        while empty < idle_polls and time.monotonic() < deadline:
            msgs = consumer.poll(timeout_s=1.0, max_records=1000)
            # Idle polls count once the group gave us the partitions: a join can take seconds on a
            # loaded machine, and polls before it return nothing although the topics are full.
            empty = 0 if msgs or not consumer.assignment else empty + 1
            for m in msgs:
                if m.topic == topics.trajectories and m.table is not None:
                    trajs += traj_rec.from_table(m.table)
                elif m.topic in by_batch_topic and m.table is not None:
                    batches[by_batch_topic[m.topic]].append(batch_rec.from_table(m.table))
                elif m.topic in by_weight_topic and isinstance(announcement := m.record, WeightAnnouncement):
                    # an announcement carries no time of its own: the log's timestamp is when it was sent
                    sent = None if m.timestamp_ms is None else m.timestamp_ms / 1000.0
                    announced[by_weight_topic[m.topic]].append((announcement.version, sent))
    finally:
        consumer.close()
    for p in policies:  # a redelivered batch (same id) counts once, in order
        seen, uniq = set(), []
        for b in sorted(batches[p], key=lambda b: b.batch_id):
            if b.batch_id not in seen:
                seen.add(b.batch_id)
                uniq.append(b)
        batches[p] = uniq
    return batches, trajs, announced


# -- reading the records ------------------------------------------------------------------------
def trainer_steps(metrics: list[ControlRecord], policy: str) -> list[TrainerStep]:
    """The trainer's per-step records (last life wins for a step), ordered by step."""
    steps = {}
    for r in metrics:
        if isinstance(r, TrainerStep) and r.policy == policy:
            steps[r.step] = r
    return [steps[k] for k in sorted(steps)]


def batch_index(batch_id: str) -> int:
    """A batch's index in its policy's sequence (``<run>-<policy>-<k>`` -> k): the trainer version that
    trains it, for a trainer starting at v0."""
    return int(batch_id.rsplit("-", 1)[1])
