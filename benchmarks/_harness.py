"""Figures shared by the scheduling benchmarks (async_vs_sync, heterogeneous_pools, cross_region,
pipeline_overhead): a run is started and read back with :mod:`astraflow.testing.runs` (private
embedded stack, the real launcher, separate component processes); this module measures it from what
it left on the log — metrics records, batches and trajectories — never from inside a component.

Definitions (all over a measurement window [first measured step, last step] of each trainer):
* iteration time: seconds between consecutive trainer steps (one step per policy = one iteration);
* trainer idle fraction: sum of the trainer's ``wait_s`` (blocked waiting for a batch) / window;
* rollout idle fraction: share of the window during which a node runs no episode (episode spans
  come from the trajectories: ``created_at`` is the episode end, ``gen_seconds`` per policy phase);
* staleness of a trained trajectory: version of the trainer that trained it (the batch's index,
  since a trainer starting at v0 trains batch k at version k) minus the trajectory's oldest token
  version;
* refresh lag: from a node's metrics records (``refresh_s``: seconds of the last pull + load) and
  the version lag (latest announced version - the node's version) sampled at each record.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from astraflow.records.control import TRAINER_RECORDS, ControlRecord, DataflowCounters, NodeStatus
from astraflow.testing.runs import RunRecords, batch_index, trainer_steps

ROOT = Path(__file__).resolve().parent.parent


# -- measurements ----------------------------------------------------------------------------------
def staleness_histogram(batches: dict[str, list], trained: dict[str, int] | None = None) -> Counter:
    """Staleness of every trained trajectory (the first ``trained[policy]`` batches), all policies."""
    h: Counter = Counter()
    for p, bs in batches.items():
        for b in bs[: (trained or {}).get(p, len(bs))]:
            v = batch_index(b.batch_id)
            for t in b.trajectories:
                h[v - t.min_version] += 1
    return h


def _task_spans(trajs: list) -> dict[str, dict[str, tuple[float, float]]]:
    """Per node, per task: (start, end) of its episode."""
    by_task: dict[tuple[str, str], list] = defaultdict(list)
    for t in trajs:
        by_task[(t.node_id, t.task_id)].append(t)
    spans: dict[str, dict] = defaultdict(dict)
    for (node, task), ts in by_task.items():
        end = max(t.created_at for t in ts)
        phases = {t.policy: t.gen_seconds for t in ts}  # one generation phase per policy
        spans[node][task] = (end - sum(phases.values()), end)
    return spans


def episode_spans(trajs: list) -> dict[str, list[tuple[float, float]]]:
    """Per node, (start, end) of every episode (deduplicated by task)."""
    return {node: list(d.values()) for node, d in _task_spans(trajs).items()}


def busy_seconds(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]
    return {"p50": round(pick(0.5), 3), "p90": round(pick(0.9), 3), "max": round(xs[-1], 3)}


def summarize(rec: RunRecords, *, warmup_steps: int, node_pool: dict[str, str] | None = None) -> dict[str, Any]:
    """Scheduling figures of one run (see the module docstring for the definitions)."""
    policies = list(rec.batches)
    per_policy, windows = {}, []
    for p in policies:
        steps = trainer_steps(rec.metrics, p)
        measured = steps[warmup_steps:]
        if len(measured) < 2:
            raise RuntimeError(f"run {rec.run_id}: policy {p} has only {len(steps)} step records "
                               f"({rec.reason}); nothing to measure")
        t0, t1 = measured[0].time, measured[-1].time
        window = t1 - t0
        windows.append((t0, t1))
        # The trainer loop's own clock: wait for a batch + step + hand-off to the publisher. (Record
        # timestamps are taken when a version's upload finished, which lags by a varying amount.)
        loop_s = [s.wait_s + s.step_s + s.publish_blocked_s for s in measured[1:]]
        per_policy[p] = {
            "steps": len(steps),
            "iteration_s": round(statistics.mean(loop_s), 3),
            "iteration_s_p50": round(statistics.median(loop_s), 3),
            "iteration_s_by_records": round(window / (len(measured) - 1), 3),
            "trainer_idle_fraction": round(sum(s.wait_s for s in measured[1:]) / sum(loop_s), 3),
            "step_s_mean": round(statistics.mean(s.step_s for s in measured[1:]), 3),
            "staleness_max_reported": max(s.staleness_max for s in steps),
        }
    lo, hi = max(w[0] for w in windows), min(w[1] for w in windows)
    spans = episode_spans(rec.trajectories)
    idle = {n: round(1.0 - busy_seconds(s, lo, hi) / (hi - lo), 3) for n, s in sorted(spans.items())}
    in_window = [t for t in rec.trajectories if lo <= t.created_at <= hi]
    lengths = [len(t.response_ids) for t in rec.trajectories]
    dataflow = [r for r in rec.metrics if isinstance(r, DataflowCounters)]
    counters = dataflow[-1].counters if dataflow else {}
    dropped = {k.split(".", 1)[1]: v for k, v in counters.items()
               if k.startswith("trajectories.") and v and k.split(".", 1)[1] in
               ("stale", "expired", "in_dropped_group", "unknown_task", "duplicate", "unknown_policy")}
    # Rollout span of a trained batch: first episode start to last episode end among its tasks
    # (in sync mode: the wave, which lasts as long as its slowest episode).
    task_span: dict[str, tuple[float, float]] = {}
    for node_spans in _task_spans(rec.trajectories).values():
        task_span.update(node_spans)
    first = policies[0]
    batch_spans = []
    for b in rec.batches[first][warmup_steps: per_policy[first]["steps"]]:
        ss = [task_span[t.task_id] for t in b.trajectories if t.task_id in task_span]
        if ss:
            batch_spans.append(max(e for _, e in ss) - min(s for s, _ in ss))
    hist = staleness_histogram(rec.batches, {p: v["steps"] for p, v in per_policy.items()})
    out = {
        "iteration_s": round(max(v["iteration_s"] for v in per_policy.values()), 3),
        "trainer_idle_fraction": round(statistics.mean(v["trainer_idle_fraction"] for v in per_policy.values()), 3),
        "rollout_idle_fraction": round(statistics.mean(idle.values()), 3) if idle else None,
        "rollout_idle_by_node": idle,
        "batch_rollout_span_s": round(statistics.mean(batch_spans), 3) if batch_spans else None,
        "rollout_tokens_per_s": round(sum(len(t.response_ids) for t in in_window) / (hi - lo), 1),
        "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "staleness_max": max(hist) if hist else None,
        "trajectories_trained": sum(hist.values()),
        "batches_untrained_at_end": {p: len(bs) - per_policy[p]["steps"] for p, bs in rec.batches.items()},
        "trajectories_produced": len(rec.trajectories),
        "tokens_produced": sum(lengths),
        "trajectories_dropped": dropped,
        # dataflow.stale_tokens: mask: kept with their stale tokens masked out of the loss
        "trajectories_partly_stale": counters.get("trajectories.partly_stale", 0),
        "stale_tokens_masked": counters.get("trajectories.stale_tokens_masked", 0),
        # sampling.regenerate_stale_after: continuations decoded again on the nodes (the replaced ones
        # were never sent, so they are not in trajectories_produced)
        "continuations_regenerated": _node_counter(rec.metrics, ".regenerated"),
        "regenerated_tokens": _node_counter(rec.metrics, ".regenerated_tokens"),
        "response_tokens": quantiles([float(x) for x in lengths]),
        "policies": per_policy,
        "wall_s": round(rec.wall_s, 1),
        "run": rec.run_id,
        "ok": rec.returncode == 0,
    }
    if node_pool is not None:
        out["pools"] = pool_figures(rec, node_pool, warmup_steps)
    return out


def _node_counter(metrics: list[ControlRecord], suffix: str) -> int:
    """The nodes' cumulative workflow counter (``<policy><suffix>``), summed over nodes and policies at
    each node's last metrics record."""
    last: dict[str, dict] = {}
    for r in metrics:
        if isinstance(r, NodeStatus):
            last[r.node_id] = r.workflow
    return sum(v for counters in last.values() for k, v in counters.items() if k.endswith(suffix))


def pool_figures(rec: RunRecords, node_pool: dict[str, str], warmup_steps: int) -> dict[str, Any]:
    """Per pool: trajectories in each trained batch, refresh seconds, version lag at metrics records."""
    pools = sorted(set(node_pool.values()))
    per_iter: dict[str, list[int]] = {p: [] for p in pools}
    for policy, bs in rec.batches.items():
        for b in bs[warmup_steps: len(trainer_steps(rec.metrics, policy))]:
            c = Counter(node_pool.get(t.node_id, "?") for t in b.trajectories)
            for p in pools:
                per_iter[p].append(c.get(p, 0))
    latest: dict[str, int] = {}
    refresh: dict[str, list[float]] = defaultdict(list)
    lag: dict[str, list[int]] = defaultdict(list)
    for r in rec.metrics:
        if isinstance(r, TRAINER_RECORDS):
            latest[r.policy] = max(latest.get(r.policy, 0), r.version)
        elif isinstance(r, NodeStatus):
            if r.refresh_s:
                refresh[r.pool].append(r.refresh_s)
            for pol, v in r.versions.items():
                if pol in latest:
                    lag[r.pool].append(max(0, latest[pol] - v))
    return {
        p: {
            "trajectories_per_iteration": per_iter[p],
            "min_per_iteration": min(per_iter[p]) if per_iter[p] else 0,
            "share": round(sum(per_iter[p]) / max(1, sum(sum(v) for v in per_iter.values())), 3),
            "refresh_s": quantiles(refresh.get(p, [])),
            "version_lag_at_metrics": quantiles([float(x) for x in lag.get(p, [])]),
        }
        for p in pools
    }


def wall() -> float:
    return time.monotonic()
