"""``astraflow run``: launch a recipe's components as separate processes and follow the run.

The launcher is only a convenience: it creates the run's topics, starts the dataflow, one trainer
per policy and the RaaS nodes (each exactly as ``astraflow <component>`` would start on another
machine), reads ``<run>.metrics`` for the live view and ``metrics.jsonl``, and stops everything
when every trainer is done, on Ctrl+C / SIGTERM, or when a component dies.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import ClusterConfig
from astraflow.launcher.plan import (
    cluster_for_run,
    component_specs,
    effective_recipe,
    run_topics,
    write_recipe,
)
from astraflow.launcher.progress import RunProgress
from astraflow.launcher.supervisor import ChildExited, ProcessGroup
from astraflow.recipe import Recipe


@dataclass
class RunOptions:
    run_id: str | None = None
    """Run id (topics, bucket prefix, ``runs/<run>``); default ``<recipe run>-<timestamp>``, a fresh
    run. Reusing an id resumes that run from its checkpoints."""
    steps: int | None = None
    """Override ``trainer.steps``."""
    nodes: dict[str, int] = field(default_factory=dict)
    """Override ``nodes`` per pool."""
    runs_dir: Path = Path("runs")
    grace_s: float = 15.0
    """Seconds between SIGTERM and SIGKILL when stopping components."""
    timeout_s: float | None = None
    """Stop the run (non-zero exit) if not done after this many seconds."""
    live: bool | None = None
    """Rich live table (default: when stdout is a terminal); else a progress line every few seconds."""
    threads: int = 1
    """Torch threads per component process."""


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    returncode: int
    reason: str
    """"done", "interrupted", "timeout" or the failure message."""
    wall_s: float
    trainers: dict[str, dict[str, Any]]
    """Last step record per policy."""
    done: dict[str, dict[str, Any]]
    """The ``done`` record per policy that finished."""
    metrics_path: Path
    report_path: Path | None
    records: int


class _Terminate(Exception):
    """SIGTERM to the launcher: stop the run like Ctrl+C does."""


def default_run_id(recipe: Recipe) -> str:
    return f"{recipe.run}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def launch(recipe: Recipe, cfg: ClusterConfig, opts: RunOptions, console=None) -> RunResult:
    """Run ``recipe`` on the resolved cluster ``cfg`` until done / interrupted / failed."""
    from rich.console import Console

    from astraflow.launcher.cluster import write_cluster_file
    from astraflow.log import LogConsumer, Topics, ensure_topics
    from astraflow.report import MetricsLog, write_report

    console = console or Console()
    run_id = opts.run_id or default_run_id(recipe)
    recipe = effective_recipe(recipe, run_id=run_id, steps=opts.steps, nodes=opts.nodes)
    cfg = cluster_for_run(cfg, run_id)
    run_dir = (opts.runs_dir / run_id).absolute()
    recipe_file = write_recipe(recipe, run_dir / "recipe.yaml")
    cluster_file = write_cluster_file(cfg, run_dir / "cluster.yaml")
    ensure_topics(cfg, run_topics(recipe, run_id))

    policies = [p.name for p in recipe.policies]
    progress = RunProgress(run=run_id, steps=recipe.trainer.steps, policies=policies)
    metrics_path = run_dir / "metrics.jsonl"
    specs = component_specs(recipe, recipe_file, cluster_file, run_dir, threads=opts.threads)
    group = ProcessGroup(grace_s=opts.grace_s)
    # A group of its own (unique id): the launcher only reads, and must not take partitions from
    # the dataflow's metrics consumer.
    consumer = LogConsumer(cfg, Topics(run_id).metrics, group_id=f"{run_id}.launcher.{uuid.uuid4().hex[:6]}",
                           client_id=f"launcher-{run_id}")
    metrics = MetricsLog(metrics_path)
    live_enabled = console.is_terminal if opts.live is None else opts.live
    reason, rc = "done", 0
    t0 = time.monotonic()
    previous_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise _Terminate()

    def absorb(timeout_s: float, max_records: int) -> int:
        """One poll of the metrics topic into metrics.jsonl and the progress view; records polled."""
        batch = consumer.poll(timeout_s=timeout_s, max_records=max_records)
        for msg in batch:
            if isinstance(msg.obj, dict):
                metrics.append(msg.obj)
                progress.update(msg.obj)
        return len(batch)

    with contextlib.suppress(ValueError):  # not the main thread: Ctrl+C handling only
        signal.signal(signal.SIGTERM, on_term)

    console.print(f"[bold]run {run_id}[/bold]: {len(specs)} components "
                  f"({', '.join(s.name for s in specs)}); logs in {run_dir / 'logs'}")
    try:
        for spec in specs:
            group.start(spec)
        live = None
        if live_enabled:
            from rich.live import Live

            live = Live(progress.render(), console=console, refresh_per_second=2, transient=False)
            live.start()
        last_line = 0.0
        try:
            while True:
                absorb(0.5, 500)
                finished = group.check()
                trainers_exited = all(f"trainer-{p}" in finished for p in policies)
                if progress.all_done or trainers_exited:
                    break
                if opts.timeout_s is not None and time.monotonic() - t0 > opts.timeout_s:
                    reason, rc = f"timeout: not done after {opts.timeout_s:.0f} s", 1
                    break
                if live is not None:
                    live.update(progress.render())
                elif time.monotonic() - last_line > 5.0:
                    console.print(progress.summary_line(), highlight=False)
                    last_line = time.monotonic()
            if rc == 0:
                # Trainers exit by themselves after "done" (final checkpoint, publisher drained):
                # give them the grace period before the stop signal reaches them.
                trainers = {f"trainer-{p}" for p in policies}
                deadline = time.monotonic() + opts.grace_s
                while trainers & set(group.alive()) and time.monotonic() < deadline:
                    absorb(0.2, 500)
        finally:
            if live is not None:
                live.update(progress.render())
                live.stop()
    except ChildExited as exc:
        reason, rc = str(exc), 1
        console.print(f"[red]run {run_id} failed:[/red] {exc}", highlight=False)
    except (KeyboardInterrupt, _Terminate):
        reason, rc = "interrupted", 130
        console.print(f"[yellow]interrupted: stopping {len(group.alive())} components ...[/yellow]")
    finally:
        codes = group.stop()
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous_term)
        # Records written just before the stop (last steps, done events) are still on the topic.
        with contextlib.suppress(Exception):
            while absorb(1.0, 5000):  # until the topic is drained
                pass
        with contextlib.suppress(Exception):
            consumer.close()
        metrics.close()
    wall = time.monotonic() - t0
    if rc == 0 and not progress.all_done:
        missing = [p for p in policies if p not in progress.done]
        if missing:
            console.print(f"[yellow]trainers {missing} exited without a 'done' metrics record[/yellow]")
    report_path = None
    try:
        from astraflow.report import load_metrics

        report_path = write_report(load_metrics(metrics_path), run_dir / "report.png", title=f"run {run_id}")
    except Exception as exc:  # noqa: BLE001 - a failed plot must not hide the run's outcome
        console.print(f"[yellow]report.png not written: {exc}[/yellow]")
    console.print(progress.summary_line(), highlight=False)
    console.print(f"run {run_id}: {reason if rc else 'done'} after {wall:.0f} s; exit codes "
                  f"{codes}; metrics {metrics_path} ({metrics.count} records)"
                  + (f", report {report_path}" if report_path else ""), highlight=False)
    return RunResult(run_id=run_id, run_dir=run_dir, returncode=rc, reason=reason, wall_s=wall,
                     trainers=dict(progress.trainers), done=dict(progress.done), metrics_path=metrics_path,
                     report_path=report_path, records=metrics.count)
