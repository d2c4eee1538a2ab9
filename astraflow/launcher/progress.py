"""Live view of a run, built only from the typed records of ``<run>.metrics`` and the launcher's own
events (:mod:`astraflow.records.control`).

``RunProgress`` folds records into the latest state per trainer, node and dataflow; ``render``
draws it as a rich table; ``summary_line`` is the one-line form printed when output is not a TTY.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from astraflow.records.control import (
    ActuatorEvent,
    AutoscaleReport,
    ControlRecord,
    DataflowCounters,
    NodeStatus,
    SupervisorEvent,
    TrainerDone,
    TrainerStart,
    TrainerStep,
)

MOSTLY_CUT = 0.5
"""Above this share of a batch's responses cut at their token cap, the view warns: the policy is
trained on answers it was not let finish (the reward sees no answer)."""


@dataclass
class RunProgress:
    run: str
    steps: int
    """Target steps per policy."""
    policies: list[str]
    trainers: dict[str, TrainerStart | TrainerStep] = field(default_factory=dict)
    """Each policy's trainer: its latest step, or its start before the first step."""
    nodes: dict[str, NodeStatus] = field(default_factory=dict)
    dataflow: DataflowCounters | None = None
    autoscale: AutoscaleReport | None = None
    done: dict[str, TrainerDone] = field(default_factory=dict)
    """Trainers that reported ``done``, by policy."""
    done_since: float | None = None
    """Unix time before which a ``done`` is an earlier launch's (the log is read from its start)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts per component, from the launcher's own supervisor events."""
    retired: set[str] = field(default_factory=set)
    """Nodes the actuator stopped: out of the view, also their late records."""
    records: int = 0
    started: float = field(default_factory=time.monotonic)

    def update(self, record: ControlRecord) -> None:
        """Fold one typed record (:func:`~astraflow.records.control.parse_control` made it)."""
        self.records += 1
        match record:
            case SupervisorEvent(event="restart"):
                self.restarts[record.component] = record.restarts
            case ActuatorEvent(event="stopped", node=str(node)):
                self.retired.add(node)
                self.nodes.pop(node, None)
            case ActuatorEvent(event="start", node=str(node)):
                self.retired.discard(node)  # a new node under a retired one's name
            case TrainerDone():
                # A resumed run reads its log from the start: a "done" of an earlier life that had a
                # smaller step target, or was written before this launch (a rollback), is history.
                if record.step >= self.steps and (self.done_since is None or record.time >= self.done_since):
                    self.done[record.policy] = record
            case TrainerStart() | TrainerStep():
                self.trainers[record.policy] = record
            case NodeStatus():
                if record.node_id not in self.retired:
                    self.nodes[record.node_id] = record
            case AutoscaleReport():
                self.autoscale = record
            case DataflowCounters():
                self.dataflow = record

    @property
    def all_done(self) -> bool:
        return bool(self.policies) and all(p in self.done for p in self.policies)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- views --------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """The dataflow's flat counters (``tasks.emitted``, ``trajectories.dropped.stale``, ...)."""
        return self.dataflow.counters if self.dataflow is not None else {}

    def dropped(self) -> dict[str, int]:
        """Non-zero counters of records dropped or expired by a rule, by counter name."""
        return {key: value for key, value in self.counters().items()
                if ("drop" in key or "expired" in key) and value}

    def weight_refusals(self) -> dict[str, int]:
        """Nodes' non-zero ``weights.refused.<reason>`` / ``weights.unreachable`` counters, summed."""
        out: dict[str, int] = {}
        for node in self.nodes.values():
            for key, value in node.counters.items():
                if key.startswith("weights.") and value:
                    out[key] = out.get(key, 0) + value
        return out

    def tokens_per_s_by_pool(self) -> dict[str, float]:
        """The nodes' latest decode rates, summed per pool."""
        out: dict[str, float] = {}
        for n in self.nodes.values():
            out[n.pool] = out.get(n.pool, 0.0) + n.tokens_per_s
        return out

    def mostly_cut(self) -> list[str]:
        """Policies whose latest batch had most responses cut at their token cap."""
        return [p for p, t in self.trainers.items()
                if isinstance(t, TrainerStep) and t.truncated_frac is not None and t.truncated_frac > MOSTLY_CUT]

    def summary_line(self) -> str:
        parts = [f"[{self.elapsed():5.0f}s]"]
        for p in self.policies:
            t = self.trainers.get(p)
            figures = ""
            if isinstance(t, TrainerStep):
                figures = f" reward {t.reward_mean:.3f}"
                if t.response_len_mean is not None:
                    figures += f" len {t.response_len_mean:.0f}/{t.response_len_max}"
                if t.truncated_frac is not None:
                    figures += f" cut {t.truncated_frac:.0%}"
                figures += f" busy {t.busy_fraction:.0%}"
            parts.append(f"{p}: step {t.step if t else '-'}/{self.steps} v{t.version if t else '-'}{figures}"
                         + (" done" if p in self.done else ""))
        pools = self.tokens_per_s_by_pool()
        tps = sum(pools.values())
        per_pool = f" ({', '.join(f'{k} {v:.0f}' for k, v in sorted(pools.items()))})" if len(pools) > 1 else ""
        parts.append(f"nodes {len(self.nodes)} {tps:.0f} tok/s{per_pool}")
        cut = self.mostly_cut()
        if cut:
            parts.append(f"WARNING most responses of {', '.join(cut)} cut at max_new_tokens: raise it")
        d = self.dropped()
        if d:
            parts.append("dropped " + ",".join(f"{k}={v}" for k, v in sorted(d.items())))
        w = self.weight_refusals()
        if w:
            parts.append(",".join(f"{k}={v}" for k, v in sorted(w.items())))
        if self.restarts:
            parts.append("restarts " + ",".join(f"{k}={v}" for k, v in sorted(self.restarts.items())))
        return " | ".join(parts)

    def render(self):
        from rich.console import Group
        from rich.table import Table

        title = f"AstraFlow run {self.run} — {self.elapsed():.0f} s, {self.records} metrics records"
        tr = Table(title=title, title_justify="left", expand=False)
        for col in ("policy", "step", "ver", "reward", "loss", "stale avg/max", "wait s", "step s", "busy",
                    "traj", "len avg/max", "cut", "kl", "clip", "state"):
            tr.add_column(col)
        for p in self.policies:
            tr.add_row(p, *_trainer_cells(self.trainers.get(p), self.steps),
                       "[green]done[/green]" if p in self.done else (
                           "training" if p in self.trainers else "[dim]starting[/dim]"))
        nodes = Table(title="RaaS nodes", title_justify="left")
        for col in ("node", "pool", "episodes", "traj", "tok/s", "busy", "refresh s", "versions"):
            nodes.add_column(col)
        for nid, n in sorted(self.nodes.items()):
            nodes.add_row(nid, n.pool, str(n.episodes), str(n.trajectories), _f(n.tokens_per_s, 0),
                          _f(n.busy_fraction, 2), _f(n.refresh_s, 2), " ".join(f"{k}:v{v}" for k, v in sorted(n.versions.items())) or "-")
        c = self.counters()
        batches = {k.split(".")[1]: v for k, v in c.items() if k.startswith("batches.") and k.endswith(".batches")}
        flow = (f"dataflow: tasks emitted {c.get('tasks.emitted', '-')}, finished {c.get('tasks.finished', '-')}, "
                f"in flight {c.get('tasks.in_flight', '-')}, batches {batches or '-'}")
        d = self.dropped()
        flow += ", dropped " + (", ".join(f"{k} {v}" for k, v in sorted(d.items())) if d else "0")
        if self.autoscale is not None and self.autoscale.pools:
            flow += f"; autoscale target nodes { {p: r.target_nodes for p, r in self.autoscale.pools.items()} }"
        cut = self.mostly_cut()
        if cut:
            flow += (f"\n[yellow]warning:[/yellow] most responses of {', '.join(cut)} are cut at max_new_tokens "
                     "(the reward sees no finished answer): raise the pool's max_new_tokens")
        if self.restarts:
            flow += "\n[yellow]restarted:[/yellow] " + ", ".join(
                f"{k} ×{v}" for k, v in sorted(self.restarts.items()))
        return Group(tr, nodes, flow)


def _trainer_cells(t: TrainerStart | TrainerStep | None, steps: int) -> list[str]:
    """A trainer's row in the live view, up to its state: a started trainer has a step and a version."""
    if not isinstance(t, TrainerStep):
        return [f"{t.step if t else '-'}/{steps}", str(t.version) if t else "-", *["-"] * 12]
    length = "-" if t.response_len_mean is None else f"{t.response_len_mean:.0f}/{t.response_len_max}"
    cut = "-" if t.truncated_frac is None else f"{t.truncated_frac:.0%}"
    return [f"{t.step}/{steps}", str(t.version), _f(t.reward_mean), _f(t.loss, 4),
            f"{_f(t.staleness_mean, 2)}/{t.staleness_max}", _f(t.wait_s, 1), _f(t.step_s, 2),
            f"{t.busy_fraction:.0%}", str(t.trajectories), length, cut, _f(t.behav_kl, 4), _f(t.clip_frac, 3)]


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
