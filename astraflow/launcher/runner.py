"""``astraflow run``: launch a recipe's components as separate processes and follow the run.

The launcher is only a convenience: it creates the run's topics, starts the dataflow, one trainer
per policy and the RaaS nodes (each exactly as ``astraflow <component>`` would start on another
machine), reads ``<run>.metrics`` for the live view and ``metrics.jsonl``, restarts a component that dies
(backoff and budget: :mod:`astraflow.launcher.restarts`), and stops everything when every trainer is
done, on Ctrl+C / SIGTERM (:mod:`astraflow.launcher.interrupts`), or when a component's restart
budget is exhausted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from astraflow.config import ClusterConfig
from astraflow.launcher.actuator import Actuator
from astraflow.launcher.actuator import describe as describe_actuation
from astraflow.launcher.interrupts import interrupt_guard, signal_name
from astraflow.launcher.plan import (
    PrometheusTargets,
    cluster_for_run,
    component_specs,
    effective_recipe,
    node_spec,
    refuse_unavailable_devices,
    run_topics,
    slot_shortfall,
    threads_per_component,
    write_recipe,
)
from astraflow.launcher.progress import RunProgress
from astraflow.launcher.restarts import RestartPolicy
from astraflow.launcher.stack_watch import StackWatch
from astraflow.launcher.supervisor import ChildExited, ChildSpec, ProcessGroup, RestartEvent, describe_exit
from astraflow.recipe import Recipe
from astraflow.records.control import (
    ActuatorEvent,
    ControlRecord,
    SupervisorEvent,
    TrainerDone,
    TrainerStart,
    TrainerStep,
)

if TYPE_CHECKING:
    from astraflow.embedded import EmbeddedStack


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
    """Seconds between SIGTERM and SIGKILL when stopping components at the end of a run."""
    interrupt_grace_s: float = 3.0
    """The same after Ctrl+C / SIGTERM (at most ``grace_s``): a person waits for the prompt, and a
    component killed mid-stop loses nothing a resumed run needs (a node's uncommitted tasks are
    delivered again, a trainer resumes from its last complete checkpoint). A node's drain (its pool's
    ``drain_timeout_s``, up to 30 s) would otherwise hold the exit for the whole ``grace_s``."""
    timeout_s: float | None = None
    """Stop the run (non-zero exit) if not done after this many seconds."""
    live: bool | None = None
    """Rich live table (default: when stdout is a terminal); else a progress line every few seconds."""
    threads: int | None = None
    """Torch threads per component process; None: the cores shared by the trainers and nodes
    (:func:`~astraflow.launcher.plan.threads_per_component`)."""
    archive: bool = True
    """Start the archiver (``astraflow archive``): the run's log as Parquet under ``<run>/archive/``."""
    from_archive: str | None = None
    """Train on the batches the recipe's dataflow section serves from this archived run
    (:mod:`astraflow.archive.feed`): only trainers (and the archiver) start, no dataflow, no node."""
    from_checkpoint: int | None = None
    """Restart run ``run_id`` from every policy's kept checkpoint of this step (:mod:`astraflow.launcher.rollback`)."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """Backoff and budget for restarting a component (or a server of ``stack``) that dies."""
    prometheus: bool = False
    """Each component serves ``/metrics`` on a free loopback port, listed in ``<run>/prometheus.json``."""
    stack: EmbeddedStack | None = None
    """The embedded stack started for this run (``open_run_cluster``): its servers are restarted
    like components. None when the run uses a stack or cluster it did not start."""


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    returncode: int
    reason: str
    """"done", "interrupted", "timeout" or the failure message."""
    restarts: dict[str, int]
    """Restarts per component that was restarted."""
    wall_s: float
    trainers: dict[str, TrainerStart | TrainerStep]
    """Each policy's last step record (its start record before the first step)."""
    done: dict[str, TrainerDone]
    """The ``done`` record per policy that finished."""
    metrics_path: Path
    report_path: Path | None
    records: int


def default_run_id(recipe: Recipe) -> str:
    return f"{recipe.run}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


class _Monitor:
    """The launcher's reading side: ``<run>.metrics`` into ``metrics.jsonl`` and the progress view,
    plus the launcher's own supervisor records."""

    def __init__(self, cfg: ClusterConfig, run_id: str, progress: RunProgress, metrics_path: Path,
                 warn: Callable[[str], None]) -> None:
        from kafka.errors import KafkaError

        from astraflow.log import LogConsumer, Topics
        from astraflow.log.errors import LogError
        from astraflow.records.control import METRICS_TOPIC_SCHEMAS
        from astraflow.report import MetricsLog

        self.progress = progress
        self.subscribers: list[Callable[[ControlRecord], None]] = []
        """Also given every record read from the topic (the actuator reads the autoscaling reports)."""
        self.metrics = MetricsLog(metrics_path)
        self.warn = warn
        self._broker_errors = (KafkaError, LogError)
        self._outage: str | None = None
        self.topic = Topics(run_id).metrics
        # A group of its own (unique id): the launcher only reads, and must not take partitions from
        # the dataflow's metrics consumer.
        self.consumer = LogConsumer(cfg, self.topic, group_id=f"{run_id}.launcher.{uuid.uuid4().hex[:6]}",
                                    expected_schemas={self.topic: METRICS_TOPIC_SCHEMAS}, client_id=f"launcher-{run_id}", background=True)

    def absorb(self, timeout_s: float, max_records: int) -> int:
        """One poll of the metrics topic into metrics.jsonl and the progress view; records polled.
        A broker that is away (restarting, a blip of an external cluster) is waited for, one line
        per outage: the records stay on the topic, and supervision must go on meanwhile."""
        try:
            batch = self.consumer.poll(timeout_s=timeout_s, max_records=max_records)
        except self._broker_errors as exc:
            if self._outage is None:
                self._outage = type(exc).__name__
                self.warn(f"cannot read {self.topic} ({self._outage}: {exc}); retrying")
            time.sleep(timeout_s)
            return 0
        if self._outage is not None:
            self.warn(f"reading {self.topic} again")
            self._outage = None
        for msg in batch:
            if isinstance(msg.obj, dict):
                self.metrics.append(msg.obj)  # as written: metrics.jsonl keeps untyped figures too
            if (record := msg.record) is not None:  # a control record, parsed at decode (a bad one never gets here)
                self.progress.update(record)
                for subscriber in self.subscribers:
                    subscriber(record)
        return len(batch)

    def record(self, record: ControlRecord) -> None:
        """One of the launcher's own records (a supervisor or actuator event)."""
        self.metrics.append(record.to_json())
        self.progress.update(record)

    def close(self, drain_s: float = 30.0) -> None:
        """Drain what the components wrote just before the stop (last steps, done events), for at
        most about ``drain_s`` seconds, close."""
        deadline = time.monotonic() + drain_s
        poll_s = min(1.0, max(drain_s / 4, 0.1))
        with contextlib.suppress(Exception):
            while self.absorb(poll_s, 5000) and time.monotonic() < deadline:
                pass
        with contextlib.suppress(Exception):
            self.consumer.close()
        self.metrics.close()


class _Supervised(Protocol):
    """What the launcher's loop restarts: the component group, the owned embedded stack."""

    def check(self, now: float | None = None) -> list[RestartEvent]: ...

    def restarts(self) -> dict[str, int]: ...


def _supervise(group: ProcessGroup, watched: list[_Supervised], monitor: _Monitor, policies: list[str],
               opts: RunOptions, console, live) -> tuple[str, int]:
    """Follow the run until every trainer is done or the timeout; restart what dies (``watched``:
    the component group and, when the run owns it, the embedded stack). Returns (reason,
    returncode); raises :class:`ChildExited` when a restart budget is exhausted."""
    progress = monitor.progress
    t0, last_line = time.monotonic(), 0.0
    while True:
        monitor.absorb(0.5, 500)
        for event in [e for w in watched for e in w.check()]:
            _note_restart(event, monitor, console, live)
        if progress.all_done or all(f"trainer-{p}" in group.finished() for p in policies):
            break
        if opts.timeout_s is not None and time.monotonic() - t0 > opts.timeout_s:
            return f"timeout: not done after {opts.timeout_s:.0f} s", 1
        if live is not None:
            live.update(progress.render())
        elif time.monotonic() - last_line > 5.0:
            console.print(progress.summary_line(), highlight=False)
            last_line = time.monotonic()
    # Trainers exit by themselves after "done" (final checkpoint, publisher drained): give them the
    # grace period before the stop signal reaches them.
    trainers = {f"trainer-{p}" for p in policies}
    deadline = time.monotonic() + opts.grace_s
    while trainers & set(group.alive()) and time.monotonic() < deadline:
        monitor.absorb(0.2, 500)
    return "done", 0


def _actuator(recipe: Recipe, group: ProcessGroup, monitor: _Monitor, console, opts: RunOptions,
              spec: Callable[[str, int], ChildSpec]) -> Actuator:
    """The actuator of the autoscaled pools, fed the metrics records the monitor reads. Its records go
    to metrics.jsonl, its scaling steps also to the console (above the live table, which shares it)."""
    def note(rec: ActuatorEvent) -> None:
        monitor.record(rec)
        line = describe_actuation(rec)
        if line is not None:
            console.print(line, highlight=False)

    actuator = Actuator(recipe.pools, group, spec, grace_s=opts.grace_s, note=note)
    monitor.subscribers.append(actuator.observe)
    return actuator


def _note_restart(event: RestartEvent, monitor: _Monitor, console, live) -> None:
    monitor.record(event.record())
    line = (f"[yellow]restarted {event.name}[/yellow] (it {describe_exit(event.returncode)}; "
            f"restart {event.restarts}, after {event.backoff_s:.1f} s)")
    (live.console if live is not None else console).print(line, highlight=False)


def launch(recipe: Recipe, cfg: ClusterConfig, opts: RunOptions, console=None) -> RunResult:
    """Run ``recipe`` on the resolved cluster ``cfg`` until done / interrupted / failed.

    Ctrl+C or SIGTERM at any point stops every component and returns exit status 130; one that
    arrives before a component started propagates as ``KeyboardInterrupt``."""
    from rich.console import Console

    console = console or Console()
    with interrupt_guard() as guard:
        run_id = opts.run_id or default_run_id(recipe)
        recipe = effective_recipe(recipe, run_id=run_id, steps=opts.steps, nodes=opts.nodes)
        refuse_unavailable_devices(recipe)
        if opts.threads is None:
            opts = dataclasses.replace(opts, threads=threads_per_component(recipe))
        return _launch(recipe, cluster_for_run(cfg, run_id), opts, console, guard)


def _launch(recipe: Recipe, cfg: ClusterConfig, opts: RunOptions, console, guard) -> RunResult:
    from rich.markup import escape

    from astraflow.launcher.cluster import write_cluster_file
    from astraflow.log import ensure_topics

    run_id = recipe.run
    run_dir = (opts.runs_dir / run_id).absolute()
    ensure_topics(cfg, run_topics(recipe, run_id))
    if opts.from_archive:
        recipe = _feed_from_archive(recipe, cfg, opts.from_archive, console)
    if opts.from_checkpoint is not None:
        from astraflow.launcher.rollback import roll_back

        roll_back(cfg, [p.name for p in recipe.policies], opts.from_checkpoint,
                  lambda m: console.print(m, highlight=False))
    recipe_file = write_recipe(recipe, run_dir / "recipe.yaml")
    cluster_file = write_cluster_file(cfg, run_dir / "cluster.yaml")

    policies = [p.name for p in recipe.policies]
    if cfg.role_credentials_dir is not None:  # a secured embedded stack: each trainer writes its policy's only
        from astraflow.embedded import EmbeddedStack

        if added := EmbeddedStack(cfg.state_dir, secure=True).scope_trainers(policies):
            console.print(f"secured stack: trainer keys scoped to their policy ({', '.join(added)})", highlight=False)
    # a "done" written before this launch is history (a rollback's run ends at the step the first life did)
    progress = RunProgress(run=run_id, steps=recipe.trainer.steps, policies=policies, done_since=time.time())
    metrics_path = run_dir / "metrics.jsonl"
    specs = component_specs(recipe, recipe_file, cluster_file, run_dir, threads=opts.threads,
                            archive=opts.archive, rollouts=not opts.from_archive,
                            credentials_dir=cfg.role_credentials_dir)
    prometheus = PrometheusTargets(run_dir) if opts.prometheus else None
    if prometheus is not None:
        specs = [prometheus.serve(s) for s in specs]
    group = ProcessGroup(grace_s=opts.grace_s, restart=opts.restart)
    watched: list[_Supervised] = [group]
    if opts.stack is not None:
        # A restarted in-memory broker has lost the topics; with the durable log this is a no-op.
        watched.append(StackWatch(opts.stack, opts.restart,
                                  on_broker_restart=lambda: ensure_topics(cfg, run_topics(recipe, run_id))))
    live_enabled = console.is_terminal if opts.live is None else opts.live
    t0 = time.monotonic()
    console.print(f"[bold]run {run_id}[/bold]: {len(specs)} components "
                  f"({', '.join(s.name for s in specs)}), {opts.threads} torch "
                  f"thread{'s' if opts.threads != 1 else ''} each; logs in {run_dir / 'logs'}")
    if opts.prometheus:
        console.print(f"Prometheus: each component's /metrics, targets in {run_dir / 'prometheus.json'}",
                      highlight=False)
    if (hint := slot_shortfall(recipe)) is not None and not opts.from_archive:
        console.print(f"[yellow]note:[/yellow] {escape(hint)}", highlight=False)
    monitor = None
    reason = ""
    try:
        monitor = _Monitor(cfg, run_id, progress, metrics_path,
                           warn=lambda m: console.print(f"[yellow]{escape(m)}[/yellow]", highlight=False))
        if not opts.from_archive and any(p.autoscale is not None for p in recipe.pools):
            def scaled_node(pool: str, i: int) -> ChildSpec:
                spec = node_spec(recipe, recipe_file, cluster_file, run_dir, pool, i, threads=opts.threads,
                                 credentials_dir=cfg.role_credentials_dir)
                return prometheus.serve(spec) if prometheus is not None else spec

            watched.append(_actuator(recipe, group, monitor, console, opts, scaled_node))
        for spec in specs:
            group.start(spec)
        live = None
        if live_enabled:
            from rich.live import Live

            live = Live(progress.render(), console=console, refresh_per_second=2, transient=False)
            live.start()
        try:
            reason, rc = _supervise(group, watched, monitor, policies, opts, console, live)
        finally:
            if live is not None:
                with guard.shielded():
                    live.update(progress.render())
                    live.stop()
    except ChildExited as exc:
        reason, rc = str(exc), 1
        if monitor is not None:
            monitor.record(SupervisorEvent(component=exc.name, event="failed", returncode=exc.returncode,
                                           restarts=exc.restarts, time=time.time()))
        console.print(f"[red]run {run_id} failed:[/red] {escape(str(exc))}", highlight=False)  # a log tail: no markup
    except KeyboardInterrupt as exc:
        reason, rc = "interrupted", 130
        console.print(f"[yellow]interrupted ({signal_name(exc)}): stopping {len(group.alive())} components "
                      f"...[/yellow]", highlight=False)
    finally:
        interrupted = reason == "interrupted"
        with guard.shielded():
            codes = group.stop(min(opts.grace_s, opts.interrupt_grace_s) if interrupted else None)
            if monitor is not None:
                monitor.close(drain_s=1.0 if interrupted else 30.0)
    with guard.shielded():
        restarts = {k: v for w in watched for k, v in w.restarts().items()}
        # Interrupted: the components are down and the metrics drained, so the stack started for the
        # run stops while the report is drawn (its owner's later ``down`` then finds nothing to stop).
        stopping = None
        if reason == "interrupted" and opts.stack is not None:
            stopping = threading.Thread(target=opts.stack.down, name="stack-down", daemon=True)
            stopping.start()
        try:
            return _finish(run_id, run_dir, progress, monitor, restarts, codes, reason, rc, t0, console)
        finally:
            if stopping is not None:
                stopping.join()


def _feed_from_archive(recipe: Recipe, cfg: ClusterConfig, source: str, console) -> Recipe:
    """Put the batches of ``source``'s archive on the run's batch topics; the recipe's steps capped at
    the batches there are for its least-fed policy."""
    from astraflow.archive.feed import feed_archive

    console.print(f"replaying the archive of {source} through the recipe's dataflow section ...", highlight=False)
    fed = feed_archive(cfg, recipe, source)
    kept, received = fed.counters.get("trajectories.kept", 0), fed.counters.get("trajectories.received", 0)
    console.print(f"{'fed' if fed.produced else 'already fed (earlier life of this run)'}: batches per policy "
                  f"{fed.batches} from {source} ({kept} of {received} archived trajectories kept)", highlight=False)
    steps = min(fed.batches.values())
    if steps == 0:
        empty = [p for p, n in fed.batches.items() if n == 0]
        raise ValueError(f"the archive of {source} gives no batch for policies {empty} under this recipe's "
                         f"dataflow section (check the policy names and groups_per_batch)")
    if steps >= recipe.trainer.steps:
        return recipe
    console.print(f"[yellow]trainer steps capped at {steps}: the archive holds no more batches[/yellow]")
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"steps": steps})})


def _finish(run_id: str, run_dir: Path, progress: RunProgress, monitor, restarts: dict[str, int],
            codes: dict[str, int], reason: str, rc: int, t0: float, console) -> RunResult:
    """Report, summary lines, result."""
    from astraflow.report import load_metrics, write_report
    from astraflow.report.draw import draw_detached

    wall = time.monotonic() - t0
    metrics_path = run_dir / "metrics.jsonl"
    if rc == 0 and not progress.all_done:
        missing = [p for p in progress.policies if p not in progress.done]
        if missing:
            console.print(f"[yellow]trainers {missing} exited without a 'done' metrics record[/yellow]")
    report_path, drawing = None, ""
    try:
        if reason == "interrupted":  # the prompt first: the picture is drawn by a process of its own
            draw_detached(metrics_path, run_dir / "report.png", f"run {run_id}")
            report_path, drawing = run_dir / "report.png", " (being drawn)"
        else:
            report_path = write_report(load_metrics(metrics_path), run_dir / "report.png", title=f"run {run_id}")
    except Exception as exc:  # noqa: BLE001 - a failed plot must not hide the run's outcome
        console.print(f"[yellow]report.png not written: {exc}[/yellow]")
    records = monitor.metrics.count if monitor is not None else 0
    console.print(progress.summary_line(), highlight=False)
    console.print(f"run {run_id}: {reason if rc else 'done'} after {wall:.0f} s; exit codes "
                  f"{codes}; metrics {metrics_path} ({records} records)"
                  + (f", report {report_path}{drawing}" if report_path else ""), highlight=False)
    return RunResult(run_id=run_id, run_dir=run_dir, returncode=rc, reason=reason, restarts=restarts,
                     wall_s=wall, trainers=dict(progress.trainers), done=dict(progress.done),
                     metrics_path=metrics_path, report_path=report_path, records=records)
