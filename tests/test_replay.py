"""Offline replay (astraflow.archive.replay): the dataflow's own rules over archived events, and the
``--variant`` parser. The archive read from the real bucket is covered by tests/test_archive_e2e.py."""

from __future__ import annotations

import pytest
from fakes import make_trajectory

from astraflow.archive.replay import Event, replay, trajectory_events
from astraflow.cli.replay import parse_variant
from astraflow.config import ConfigError
from astraflow.dataflow.config import DataflowConfig
from astraflow.records import Trajectory, trajectory


def traj(task: str, i: int, version: int, reward: float) -> Trajectory:
    return make_trajectory(task, "p", i, n=2, version=version, reward=reward, prompt_ids=[1], response_ids=[2, 3],
                           logprobs=[-0.1, -0.2], task_type="math" if task < "t5" else "code")


def events() -> list[Event]:
    """Ten tasks of 2 samples, 2 groups per batch; tasks t0..t3 rewarded 0/1, the rest all-equal. The
    trainer announces version k // 2 before task k, whose tokens are at that version — except t8 and
    t9, late tokens of version 0 (stale beyond max_staleness 1)."""
    out, ts = [], 0
    for k in range(10):
        if k % 2 == 0 and k:
            out.append(Event(ts, -1, k, "weights", policy="p", version=k // 2))
            ts += 1
        rewards = (0.0, 1.0) if k < 4 else (1.0, 1.0)
        version = 0 if k >= 8 else k // 2
        out.append(Event(ts, 0, k, "trajectories", [traj(f"t{k}", i, version, rewards[i]) for i in range(2)]))
        ts += 1
    return out


BASE = DataflowConfig(policies=["p"], groups_per_batch=2, max_staleness=1)


def test_replay_counts_every_trajectory_by_the_dataflow_rules():
    own = replay("recipe", BASE, events(), group_size=2).summary()
    assert own["received"] == 20
    assert own["dropped"]["stale"] == 4 and own["groups_dropped"] == {"group_too_small": 2}
    assert own["kept"] == 16 and own["batches"] == 4 and own["trajectories_batched"] == 16
    assert own["zero_variance_groups"] == 4 and own["groups_batched"] == 8
    assert own["by_task_type"]["math"] == {"received": 10, "batched": 10}
    assert own["staleness"] == {"0": 16}
    dapo = replay("dapo", BASE.model_copy(update={"filters": [{"type": "dynamic_sampling"}]}),
                  events(), group_size=2).summary()
    assert dapo["kept"] == 8 and dapo["groups_dropped"]["filter:dynamic_sampling"] == 4
    assert dapo["zero_variance_groups"] == 0 and dapo["advantage_abs_mean"] == 0.5


def test_trajectory_events_regroup_rows_by_log_record():
    t = trajectory.to_table([traj("t0", 0, 0, 1.0), traj("t0", 1, 0, 0.0), traj("t1", 0, 0, 1.0)])
    import pyarrow as pa

    t = t.append_column("log_partition", pa.array([0, 0, 0], pa.int32()))
    t = t.append_column("log_offset", pa.array([5, 5, 6], pa.int64()))
    t = t.append_column("log_timestamp_ms", pa.array([100, 100, 90], pa.int64()))
    evs = list(trajectory_events([t.slice(0, 1), t.slice(1)]))  # a record split across row groups
    assert [(e.offset, len(e.trajectories)) for e in evs] == [(5, 2), (6, 1)]


def test_variant_specs(tmp_path):
    name, cfg = parse_variant("dapo={filters: [dynamic_sampling]}", BASE)
    assert name == "dapo" and cfg.filters[0].type == "dynamic_sampling" and cfg.groups_per_batch == 2
    f = tmp_path / "v.yaml"
    f.write_text("dataflow:\n  max_staleness: 0\n")
    assert parse_variant(f"fresh={f}", BASE)[1].max_staleness == 0
    for bad, words in [("noequals", "NAME=SPEC"), ("x=[1, 2]", "mapping"), ("x={max_stalenes: 0}", "x"),
                       ("x={filters: [no_such_filter]}", "no_such_filter")]:
        with pytest.raises((ConfigError, ValueError), match=words):
            name, cfg = parse_variant(bad, BASE)
            replay(name, cfg, [], group_size=2)
