"""``report.png`` of a run: reward per policy vs step, node throughput, staleness, weight bytes, the
responses (share cut at their token cap, length) and the trainer's figures (busy share, clip share,
behaviour KL).

Reads the typed records of ``metrics.jsonl`` (matplotlib Agg backend, no display needed): the trainers'
step records and the nodes' status records, each line parsed with
:func:`~astraflow.records.control.parse_control` (no headers: ``parse_control(None, None, line)``); what does not parse (a user's own figures, a torn
last line's neighbours) is not plotted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from astraflow.records.control import (
    ControlRecord,
    ControlRecordError,
    NodeStatus,
    TrainerStep,
    parse_control,
)


def typed_records(records: Iterable[dict[str, Any]]) -> list[ControlRecord]:
    """The lines of ``metrics.jsonl`` that are records of ours, typed."""
    out = []
    for r in records:
        try:
            out.append(parse_control(None, None, r))
        except ControlRecordError:
            continue
    return out


def trainer_steps(records: Iterable[ControlRecord]) -> dict[str, list[TrainerStep]]:
    """Per policy, the trainer's step records ordered by step (a repeated step keeps the last)."""
    by_policy: dict[str, dict[int, TrainerStep]] = defaultdict(dict)
    for r in records:
        if isinstance(r, TrainerStep):
            by_policy[r.policy][r.step] = r
    return {p: [steps[s] for s in sorted(steps)] for p, steps in sorted(by_policy.items())}


def node_throughput(records: Iterable[ControlRecord]) -> dict[str, list[tuple[float, float]]]:
    """Per RaaS node, (time, tokens/s) samples."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if isinstance(r, NodeStatus):
            out[r.node_id].append((r.time, r.tokens_per_s))
    return dict(sorted(out.items()))


def write_report(records: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw the six panels into ``path`` (PNG) and return it. Panels without data say so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    typed = typed_records(records)
    steps = trainer_steps(typed)
    nodes = node_throughput(typed)
    t0 = min((r.time for r in typed if isinstance(r, TrainerStep | NodeStatus)), default=0.0)

    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    ax_reward, ax_tput, ax_stale, ax_bytes, ax_cut, ax_trainer = axes.flat

    for policy, rows in steps.items():
        ax_reward.plot([r.step for r in rows], [r.reward_mean for r in rows], marker=".", label=policy)
    _finish(ax_reward, "reward per policy", "trainer step", "mean reward", bool(steps))

    for node, samples in nodes.items():
        ax_tput.plot([t - t0 for t, _ in samples], [v for _, v in samples], marker=".", label=node)
    _finish(ax_tput, "RaaS node throughput", "seconds since start", "tokens / s", bool(nodes))

    has_stale = False
    for policy, rows in steps.items():
        xs = [r.step for r in rows]
        if xs:
            has_stale = True
            line = ax_stale.plot(xs, [r.staleness_mean for r in rows], marker=".", label=f"{policy} mean")[0]
            ax_stale.plot(xs, [r.staleness_max for r in rows], linestyle="--", color=line.get_color(),
                          label=f"{policy} max")
    _finish(ax_stale, "staleness of trained tokens", "trainer step", "versions behind", has_stale)

    has_bytes = False
    for policy, rows in steps.items():
        pts = [(r.version, r.publish_bytes) for r in rows if r.publish_bytes]
        if pts:
            has_bytes = True
            ax_bytes.plot([v for v, _ in pts], [b for _, b in pts], marker="o", linestyle="-", label=policy)
    if has_bytes:
        ax_bytes.set_yscale("log")
    _finish(ax_bytes, "weight bytes published per version", "version", "bytes", has_bytes)

    _responses_panel(ax_cut, steps)
    _trainer_panel(ax_trainer, steps)

    fig.suptitle(title or "AstraFlow run")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _finish(ax, title: str, xlabel: str, ylabel: str, has_data: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if has_data:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def _responses_panel(ax, steps: dict[str, list[TrainerStep]]) -> None:
    """Share of each batch's responses cut at their token cap (left axis) and mean length (right)."""
    has_data = False
    lengths = ax.twinx()
    for policy, rows in steps.items():
        cut = [(r.step, r.truncated_frac) for r in rows if r.truncated_frac is not None]
        if cut:
            has_data = True
            line = ax.plot([s for s, _ in cut], [f for _, f in cut], marker=".", label=f"{policy} cut")[0]
            mean = [(r.step, r.response_len_mean) for r in rows if r.response_len_mean is not None]
            lengths.plot([s for s, _ in mean], [m for _, m in mean], linestyle=":", color=line.get_color(),
                         label=f"{policy} mean length")
    ax.set_ylim(-0.02, 1.02)
    lengths.set_ylabel("mean response tokens (dotted)")
    _finish(ax, "responses cut at max_new_tokens", "trainer step", "share of batch cut", has_data)


def _trainer_panel(ax, steps: dict[str, list[TrainerStep]]) -> None:
    """Per step: the trainer's busy share, the clip share and the behaviour-vs-current KL."""
    has_data = False
    for policy, rows in steps.items():
        if not rows:
            continue
        has_data = True
        xs = [r.step for r in rows]
        line = ax.plot(xs, [r.busy_fraction for r in rows], marker=".", label=f"{policy} busy")[0]
        clip = [(r.step, r.clip_frac) for r in rows if r.clip_frac is not None]
        if clip:
            ax.plot([s for s, _ in clip], [c for _, c in clip], linestyle="--", color=line.get_color(),
                    label=f"{policy} clip")
        kl = [(r.step, r.behav_kl) for r in rows if r.behav_kl is not None]
        if kl:
            ax.plot([s for s, _ in kl], [k for _, k in kl], linestyle=":", color=line.get_color(),
                    label=f"{policy} behaviour KL")
    _finish(ax, "trainer: busy share, clip share, behaviour KL", "trainer step", "share / nats", has_data)
