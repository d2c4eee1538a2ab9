"""Live view of a run, built only from ``<run>.metrics`` records (the metrics contract).

``RunProgress`` folds records into the latest state per trainer, node and dataflow; ``render``
draws it as a rich table; ``summary_line`` is the one-line form printed when output is not a TTY.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunProgress:
    run: str
    steps: int
    """Target steps per policy."""
    policies: list[str]
    trainers: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    dataflow: dict[str, Any] = field(default_factory=dict)
    autoscale: dict[str, Any] = field(default_factory=dict)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Trainers that reported ``{"event": "done"}``, by policy."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts per component, from the launcher's own ``kind: supervisor`` records."""
    retired: set[str] = field(default_factory=set)
    """Nodes the actuator stopped (``kind: actuator``): out of the view, also their late records."""
    records: int = 0
    started: float = field(default_factory=time.monotonic)

    def update(self, rec: dict[str, Any]) -> None:
        self.records += 1
        comp = rec.get("component")
        if rec.get("kind") == "supervisor":
            if rec.get("event") == "restart":
                self.restarts[str(comp)] = int(rec.get("restarts", 0))
        elif rec.get("kind") == "actuator":
            node = str(rec.get("node"))
            if rec.get("event") == "stopped":
                self.retired.add(node)
                self.nodes.pop(node, None)
            elif rec.get("event") == "start":
                self.retired.discard(node)  # a new node under a retired one's name
        elif comp == "trainer":
            policy = str(rec.get("policy", rec.get("id", "?")))
            if rec.get("event") == "done":
                # A resumed run reads its log from the start: a "done" of an earlier life that had a
                # smaller step target is history, not the end of this run.
                if int(rec.get("step", self.steps)) >= self.steps:
                    self.done[policy] = rec
            else:
                self.trainers.setdefault(policy, {}).update(rec)
        elif comp == "raas":
            node = str(rec.get("node_id", rec.get("id", "?")))
            if node not in self.retired:
                self.nodes.setdefault(node, {}).update(rec)
        elif comp == "dataflow":
            if rec.get("kind") == "autoscale":
                self.autoscale = rec
            else:
                self.dataflow.update(rec)

    @property
    def all_done(self) -> bool:
        return bool(self.policies) and all(p in self.done for p in self.policies)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- views --------------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """The dataflow's flat counters (``tasks.emitted``, ``trajectories.dropped.stale``, ...)."""
        c = self.dataflow.get("counters")
        return c if isinstance(c, dict) else {}

    def counter(self, *names: str) -> Any:
        c = self.counters()
        for n in names:
            if n in c:
                return c[n]
            if n in self.dataflow:
                return self.dataflow[n]
        return "-"

    def dropped(self) -> dict[str, int]:
        """Non-zero counters of records dropped or expired by a rule, by counter name."""
        out = {}
        for key, value in self.counters().items():
            if isinstance(value, dict) and "drop" in key:
                out.update({f"{key}.{k}": int(v) for k, v in value.items() if isinstance(v, (int, float)) and v})
            elif ("drop" in key or "expired" in key) and isinstance(value, (int, float)) and value:
                out[key] = int(value)
        return out

    def weight_refusals(self) -> dict[str, int]:
        """Nodes' non-zero ``weights.refused.<reason>`` / ``weights.unreachable`` counters, summed."""
        out: dict[str, int] = {}
        for n in self.nodes.values():
            c = n.get("counters")
            for key, value in (c.items() if isinstance(c, dict) else ()):
                if key.startswith("weights.") and isinstance(value, (int, float)) and value:
                    out[key] = out.get(key, 0) + int(value)
        return out

    def summary_line(self) -> str:
        parts = [f"[{self.elapsed():5.0f}s]"]
        for p in self.policies:
            t = self.trainers.get(p, {})
            step = t.get("step", "-")
            reward = t.get("reward_mean")
            parts.append(f"{p}: step {step}/{self.steps} v{t.get('version', '-')}"
                         + (f" reward {reward:.3f}" if isinstance(reward, (int, float)) else "")
                         + (" done" if p in self.done else ""))
        tps = sum(float(n.get("tokens_per_s", 0) or 0) for n in self.nodes.values())
        parts.append(f"nodes {len(self.nodes)} {tps:.0f} tok/s")
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
        for col in ("policy", "step", "ver", "reward", "loss", "stale avg/max", "wait s", "step s", "traj",
                    "state"):
            tr.add_column(col)
        for p in self.policies:
            t = self.trainers.get(p, {})
            tr.add_row(
                p, f"{t.get('step', '-')}/{self.steps}", str(t.get("version", "-")), _f(t.get("reward_mean")),
                _f(t.get("loss"), 4), f"{_f(t.get('staleness_mean'), 2)}/{t.get('staleness_max', '-')}",
                _f(t.get("wait_s"), 1), _f(t.get("step_s"), 2), str(t.get("trajectories", "-")),
                "[green]done[/green]" if p in self.done else ("training" if t else "[dim]starting[/dim]"),
            )
        nodes = Table(title="RaaS nodes", title_justify="left")
        for col in ("node", "pool", "episodes", "traj", "tok/s", "busy", "versions"):
            nodes.add_column(col)
        for nid, n in sorted(self.nodes.items()):
            versions = n.get("versions") or {}
            nodes.add_row(nid, str(n.get("pool", "-")), str(n.get("episodes", "-")), str(n.get("trajectories", "-")),
                          _f(n.get("tokens_per_s"), 0), _f(n.get("busy_fraction"), 2),
                          " ".join(f"{k}:v{v}" for k, v in sorted(versions.items())) or "-")
        batches = {k.split(".")[1]: v for k, v in self.counters().items()
                   if k.startswith("batches.") and k.endswith(".batches")}
        flow = (f"dataflow: tasks emitted {self.counter('tasks.emitted', 'emitted')}, finished "
                f"{self.counter('tasks.finished', 'completed')}, in flight {self.counter('tasks.in_flight', 'in_flight')}"
                f", batches {batches or self.dataflow.get('batches', '-')}")
        d = self.dropped()
        flow += ", dropped " + (", ".join(f"{k} {v}" for k, v in sorted(d.items())) if d else "0")
        targets = self.autoscale.get("targets") or {
            pool: v.get("target_nodes") for pool, v in (self.autoscale.get("pools") or {}).items() if isinstance(v, dict)}
        if targets:
            flow += f"; autoscale target nodes {targets}"
        if self.restarts:
            flow += "\n[yellow]restarted:[/yellow] " + ", ".join(
                f"{k} ×{v}" for k, v in sorted(self.restarts.items()))
        return Group(tr, nodes, flow)


def _f(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}"
