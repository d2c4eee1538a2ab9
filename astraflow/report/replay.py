"""What ``astraflow replay`` shows: the configurations side by side, as a table and as one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROWS = [
    ("received", lambda s: s["received"]),
    ("kept", lambda s: s["kept"]),
    ("dropped: stale", lambda s: s["dropped"]["stale"]),
    ("dropped: in dropped group", lambda s: s["dropped"]["in_dropped_group"]),
    ("dropped: duplicate", lambda s: s["dropped"]["duplicate"]),
    ("pending (group unfinished)", lambda s: s["pending"]),
    ("batches", lambda s: s["batches"]),
    ("groups batched", lambda s: s["groups_batched"]),
    ("  of which zero reward variance", lambda s: s["zero_variance_groups"]),
    ("reward variance (mean per group)", lambda s: s["reward_variance_mean"]),
    ("|advantage| mean", lambda s: s["advantage_abs_mean"]),
    ("staleness at batching", lambda s: " ".join(f"{k}:{v}" for k, v in s["staleness"].items()) or "-"),
]


def replay_table(summaries: list[dict[str, Any]], online: dict[str, int] | None, title: str) -> Any:
    """A rich Table: one column per configuration, plus the online dataflow's counters when known."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for s in summaries:
        table.add_column(s["name"], justify="right")
    if online is not None:
        table.add_column("online", justify="right", style="dim")
    online_rows = _online_rows(online) if online is not None else {}
    for label, value in ROWS:
        cells = [_cell(value(s)) for s in summaries]
        if online is not None:
            cells.append(_cell(online_rows.get(label)))
        table.add_row(label, *cells)
    reasons = sorted({r for s in summaries for r in s["groups_dropped"]})
    for reason in reasons:
        cells = [_cell(s["groups_dropped"].get(reason, 0)) for s in summaries]
        if online is not None:
            cells.append(_cell(online.get(f"trajectories.groups_dropped:{reason}", 0)))
        table.add_row(f"groups dropped: {reason}", *cells)
    for key in ("by_task_type", "by_policy"):
        for name in sorted({n for s in summaries for n in s[key]}):
            cells = [_cell("{batched}/{received}".format(**s[key].get(name, {"batched": 0, "received": 0})))
                     for s in summaries]
            if online is not None:
                cells.append("")
            label = "task type" if key == "by_task_type" else "policy"
            table.add_row(f"batched/received, {label} {name or '(none)'}", *cells)
    return table


def _online_rows(c: dict[str, int]) -> dict[str, int]:
    """The online dataflow's counters under the table's row labels (a counter never hit is absent: 0)."""
    def total(suffix: str) -> int:
        return sum(v for k, v in c.items() if k.startswith("batches.") and k.endswith(suffix))

    return {
        "received": c.get("trajectories.received", 0),
        "kept": c.get("trajectories.kept", 0),
        "dropped: stale": c.get("trajectories.stale", 0),
        "dropped: in dropped group": c.get("trajectories.in_dropped_group", 0),
        "dropped: duplicate": c.get("trajectories.duplicate", 0),
        "pending (group unfinished)": c.get("trajectories.pending", 0),
        "batches": total(".batches"),
        "groups batched": total(".groups_batched"),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_replay_plot(summaries: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Stacked bars per configuration (trajectories kept / dropped by reason / pending) and the
    per-group reward variance of what was batched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [s["name"] for s in summaries]
    parts = {"kept": [s["kept"] for s in summaries]}
    for reason in ("stale", "in_dropped_group", "duplicate"):
        parts[reason] = [s["dropped"][reason] for s in summaries]
    parts["pending"] = [s["pending"] for s in summaries]
    fig, (ax_counts, ax_signal) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0] * len(names)
    for label, values in parts.items():
        ax_counts.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_counts.set_ylabel("trajectories")
    ax_counts.set_title("what each configuration keeps and drops")
    ax_counts.legend(fontsize=8)
    batched = [s["groups_batched"] for s in summaries]
    zero = [s["zero_variance_groups"] for s in summaries]
    ax_signal.bar(names, [b - z for b, z in zip(batched, zero, strict=True)], label="reward variance > 0")
    ax_signal.bar(names, zero, bottom=[b - z for b, z in zip(batched, zero, strict=True)],
                  label="zero variance (no GRPO signal)")
    ax_signal.set_ylabel("groups batched")
    ax_signal.set_title("learning signal of the batched groups")
    ax_signal.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
