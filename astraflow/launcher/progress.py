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
    records: int = 0
    started: float = field(default_factory=time.monotonic)

    def update(self, rec: dict[str, Any]) -> None:
        self.records += 1
        comp = rec.get("component")
        if comp == "trainer":
            policy = str(rec.get("policy", rec.get("id", "?")))
            if rec.get("event") == "done":
                self.done[policy] = rec
            else:
                self.trainers.setdefault(policy, {}).update(rec)
        elif comp == "raas":
            self.nodes.setdefault(str(rec.get("node_id", rec.get("id", "?"))), {}).update(rec)
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
    def dropped(self) -> dict[str, int]:
        counters = self.dataflow.get("counters", self.dataflow)
        out = {}
        for key, value in (counters or {}).items():
            if isinstance(value, dict) and key.startswith("dropped"):
                out.update({k: int(v) for k, v in value.items() if isinstance(v, (int, float))})
            elif key.startswith("dropped") and isinstance(value, (int, float)):
                out[key.removeprefix("dropped_") or key] = int(value)
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
        return " | ".join(parts)

    def render(self):
        from rich.console import Group
        from rich.table import Table

        title = f"AstraFlow run {self.run} — {self.elapsed():.0f} s, {self.records} metrics records"
        tr = Table(title=title, title_justify="left", expand=False)
        for col in ("policy", "step", "version", "reward", "loss", "staleness mean/max", "wait s",
                    "step s", "trajectories", "state"):
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
        for col in ("node", "pool", "episodes", "trajectories", "tokens/s", "busy", "versions"):
            nodes.add_column(col)
        for nid, n in sorted(self.nodes.items()):
            versions = n.get("versions") or {}
            nodes.add_row(nid, str(n.get("pool", "-")), str(n.get("episodes", "-")), str(n.get("trajectories", "-")),
                          _f(n.get("tokens_per_s"), 0), _f(n.get("busy_fraction"), 2),
                          " ".join(f"{k}:v{v}" for k, v in sorted(versions.items())) or "-")
        counters = self.dataflow.get("counters", {}) if isinstance(self.dataflow.get("counters"), dict) else {}
        flow = (f"dataflow: emitted {counters.get('emitted', '-')}, completed {counters.get('completed', '-')}, "
                f"in flight {self.dataflow.get('in_flight', '-')}, batches {self.dataflow.get('batches', '-')}")
        d = self.dropped()
        flow += ", dropped " + (", ".join(f"{k} {v}" for k, v in sorted(d.items())) if d else "0")
        if self.autoscale.get("targets"):
            flow += f"; autoscale targets {self.autoscale['targets']}"
        return Group(tr, nodes, flow)


def _f(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}"
