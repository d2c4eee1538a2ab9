"""The dataflow's saved state does not grow with the run's age (issue 28): the episode ids it keeps
for dedup are those of the tasks in flight plus a window of the last tasks to leave flight
(:mod:`astraflow.dataflow.dedup`), and a late copy beyond that window is still dropped and counted."""

from __future__ import annotations

import json

from dataflow_helpers import cfg, dataset, rollout, traj, varied

from astraflow.dataflow import Dataflow, DataflowConfig
from astraflow.records import Task


def _state_bytes(df: Dataflow) -> int:
    return len(json.dumps(df.state_dict()))


def _serve(df: Dataflow, batches: int, now: float = 0.0) -> list[Task]:
    """Run ``df`` until it has served ``batches`` batches, each trained into the next version; the
    tasks it emitted, in order. Every task's group is rolled out in full at its emitted version."""
    emitted: list[Task] = []
    served = df.batchers["solver"].counters["batches"]
    while served < batches:
        tasks = df.next_tasks(now)
        assert tasks, "the dataflow stopped emitting"
        for t in tasks:
            df.ingest(rollout(t, "solver", varied(t.samples), version=t.emitted_version))
        emitted += tasks
        for b in df.take_batches():
            served += 1
            df.on_weights("solver", df.versions["solver"] + 1, b.batch_id)
    return emitted


def test_saved_state_size_is_flat_from_batch_50_to_200():
    df = Dataflow(cfg(), dataset(1000))  # 2 groups a batch, 4 samples each, max_staleness 1
    _serve(df, 50)
    at_50 = _state_bytes(df)
    _serve(df, 200)
    at_200 = _state_bytes(df)
    assert at_200 <= 1.2 * at_50, (at_50, at_200)
    # What it keeps: the episodes of the tasks in flight and of the last dedup_window tasks, no more.
    assert len(df.processor.seen) <= (len(df.emitter.in_flight) + df.cfg.dedup_window_tasks) * 4
    assert df.processor.unaccounted() == 0


def test_a_late_copy_is_a_duplicate_within_the_window_and_unknown_task_beyond_it_across_a_restart():
    """A node re-runs tasks whose trajectories it had sent (it died before committing them): the
    copies arrive late, after the dataflow restarted from its saved state. A copy of a task that left
    flight within the last dedup_window tasks is a duplicate; an older one is unknown_task. Neither is
    trained, neither opens a group, and every trajectory is in exactly one counter."""
    section = cfg(dedup_window=10)
    df = Dataflow(section, dataset(1000))
    first, *_ = emitted = _serve(df, 40)
    finished = [t for t in emitted if t.prompt_id not in df.emitter.in_flight]
    recent = finished[-1]
    life2 = Dataflow(section, dataset(1000))
    life2.load_state_dict(json.loads(json.dumps(df.state_dict())))
    before = life2.counters()
    life2.ingest(rollout(first, "solver", varied(4)) + rollout(recent, "solver", varied(4)))
    c = life2.counters()
    assert c["trajectories.unknown_task"] - before.get("trajectories.unknown_task", 0) == 4  # the first task's
    assert c["trajectories.duplicate"] - before.get("trajectories.duplicate", 0) == 4  # the recent one's
    assert c["trajectories.kept"] == before["trajectories.kept"]
    assert life2.processor.pending == {} and life2.processor.unaccounted() == 0
    assert life2.take_batches() == []


def test_the_episodes_of_a_task_in_flight_are_never_forgotten():
    """A task for two policies finishes one group and waits for the other: a copy of the finished
    group's trajectory is a duplicate however small the window and the capacity (forgetting it would
    open that group again, and it would never finish). Once the task leaves flight the copy is
    dropped as unknown_task."""
    df = Dataflow(DataflowConfig(policies=["a", "b"], groups_per_batch=1, max_staleness=1, dedup_window=0,
                                 dedup_capacity=1), dataset(4))
    t, *_ = df.next_tasks(0.0)
    df.ingest(rollout(t, "a", varied(4)))
    df.ingest([traj(t, "a", 1, 1.0)])
    assert df.counters()["trajectories.duplicate"] == 1 and df.processor.pending == {}
    df.ingest(rollout(t, "b", varied(4)))
    assert t.prompt_id not in df.emitter.in_flight and len(df.processor.seen) == 0
    df.ingest([traj(t, "a", 1, 1.0)])
    c = df.counters()
    assert c["trajectories.duplicate"] == 1 and c["trajectories.unknown_task"] == 1
    assert df.processor.pending == {} and df.processor.unaccounted() == 0


def test_an_expired_tasks_episodes_join_the_window():
    df = Dataflow(cfg(groups_per_batch=1, max_staleness=0, task_timeout_s=10), dataset(5))
    (t,) = df.next_tasks(0.0)
    df.ingest(rollout(t, "solver", [1.0, 0.0, 1.0, 0.0])[:2])
    assert [x.prompt_id for x in df.expire(11.0)] == [t.prompt_id]
    df.ingest(rollout(t, "solver", [1.0, 0.0, 1.0, 0.0])[1:3])  # a copy of sample 1, sample 2 first seen
    c = df.counters()
    assert c["trajectories.duplicate"] == 1 and c["trajectories.unknown_task"] == 1
    assert df.processor.seen.flying == {} and list(df.processor.seen.recent) == [t.prompt_id]


def test_a_state_saved_before_the_window_loads():
    """A state saved by the code before (one list of every episode id remembered): the episodes of
    tasks in flight stay remembered as such, the rest join the window, trimmed to it."""
    df = Dataflow(cfg(dedup_window=3), dataset(100))
    _serve(df, 10)
    flying, *_ = df.next_tasks(0.0)
    df.ingest(rollout(flying, "solver", varied(4))[:1])  # half-done: one sample seen, in flight
    assert flying.prompt_id in df.emitter.in_flight
    state = json.loads(json.dumps(df.state_dict()))
    mem = state["processor"].pop("episodes")
    old_tasks = [f"old{i}" for i in range(40)]  # finished long ago: more than the window holds
    state["processor"]["seen"] = ([f"{p}/solver/{i}" for p in old_tasks for i in range(4)]
                                  + [e for t, es in mem["in_flight"].items() for e in es])
    life2 = Dataflow(cfg(dedup_window=3), dataset(100))
    life2.load_state_dict(state)
    assert life2.processor.seen.flying == {flying.prompt_id: [f"{flying.prompt_id}/solver/0"]}
    assert list(life2.processor.seen.recent) == old_tasks[-3:]
    life2.ingest([traj(flying, "solver", 0, 0.0)])
    assert life2.counters()["trajectories.duplicate"] == 1
