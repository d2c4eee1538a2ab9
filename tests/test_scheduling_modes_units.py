"""The async staleness bound of the dataflow, without a broker: emission stops when the groups ahead
of the trainer would be trained more than ``max_staleness`` versions after their emission."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from astraflow.dataflow import Dataflow, DataflowConfig
from astraflow.records import Task, Trajectory, episode_id_for, group_id_for


def _tasks(n: int) -> list[Task]:
    return [Task(f"p{i}", "q", [1, 2], "1", samples=2, task_type="t") for i in range(n)]


def _rollout(task: Task, version: int) -> list[Trajectory]:
    return [Trajectory(episode_id=episode_id_for(task.prompt_id, "pol", i), task_id=task.prompt_id,
                       group_id=group_id_for(task.prompt_id, "pol"), sample_index=i, policy="pol",
                       prompt_ids=[1], response_ids=[5], logprobs=[-1.0], versions=[version], loss_mask=[1],
                       reward=float(i % 2)) for i in range(2)]


class _Nodes:
    """Rollouts that finish at once, but only for tasks whose version is announced (a node holds a
    task until it serves ``emitted_version``)."""

    def __init__(self, df: Dataflow) -> None:
        self.df, self.held, self.emitted = df, [], {}

    def run(self, tasks: list[Task]) -> None:
        for t in tasks:
            self.emitted[t.prompt_id] = t.emitted_version
        self.held += tasks
        ready = [t for t in self.held if t.emitted_version <= self.df.versions["pol"]]
        self.held = [t for t in self.held if t.emitted_version > self.df.versions["pol"]]
        for t in ready:
            self.df.ingest(_rollout(t, t.emitted_version))


@pytest.mark.parametrize("emit_ahead", [True, False])
def test_slow_trainer_stops_emission_at_the_staleness_bound(emit_ahead):
    B, eta = 2, 1
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta,
                                 emit_ahead=emit_ahead), _tasks(100))
    nodes = _Nodes(df)
    trained_at: list[int] = []  # version at which each batch is trained (trainer: batch k at version k)
    for _round in range(6):  # the trainer never catches up unless told
        nodes.run(df.next_tasks(0.0))
        for b in df.take_batches():
            trained_at.append(len(trained_at))
            for tr in b.trajectories:
                assert trained_at[-1] - tr.min_version <= eta
    assert len(trained_at) == eta + 1  # then the bound holds emission until a new version arrives
    # Ahead: one batch's worth of the next version's tasks waits on the nodes, tagged with the oldest
    # version that keeps them within the bound (v1: trained by v2).
    assert sorted(nodes.emitted.values()) == [0] * 4 + ([1] * B if emit_ahead else [])
    assert df.next_tasks(0.0) == []
    df.on_weights("pol", 1)
    tasks = df.next_tasks(0.0)
    assert len(tasks) == B  # one more version -> one more batch worth of tasks
    assert {t.emitted_version for t in tasks} == ({2} if emit_ahead else {1})


def test_tasks_emitted_ahead_keep_the_bound_and_the_trainer_fed():
    """A trainer that trains each batch as soon as it is served, announcing its version later: every
    batch is trained within the bound, and no more than (max_staleness x groups_per_batch) tasks wait
    on the nodes for a version not announced yet."""
    B, eta = 4, 1
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta), _tasks(400))
    nodes = _Nodes(df)
    trained = 0
    for _round in range(30):
        nodes.run(df.next_tasks(0.0))
        assert len(nodes.held) <= eta * B
        for b in df.take_batches():
            assert all(trained - tr.min_version <= eta for tr in b.trajectories)
            trained += 1
        df.on_weights("pol", trained)  # announced after the round: the nodes learn it next round
    assert trained >= 25


def test_a_task_for_a_policy_the_recipe_lacks_is_emitted_ahead_without_failing():
    B, eta = 2, 1
    tasks = [Task(f"p{i}", "q", [1, 2], "1", samples=2, task_type="t", policy="pol" if i < 4 else "other")
             for i in range(8)]
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta), tasks)
    nodes = _Nodes(df)
    nodes.run(df.next_tasks(0.0))
    assert len(df.take_batches()) == 2
    ahead = df.next_tasks(0.0)  # the next tasks name "other": tagged with the announced version
    assert ahead and all(t.policy == "other" and t.emitted_version == 0 for t in ahead)


def _train_to_the_end(df: Dataflow, steps: int, *, skip: int | None = None, rounds: int = 40) -> tuple[int, int]:
    """A trainer that takes one batch a round (the skip is known only when it gets there), announcing
    each version with its batch, until ``steps`` steps (the batch served ``skip``-th is skipped as a
    duplicate); returns (steps trained, tasks emitted)."""
    nodes, queue, version, served = _Nodes(df), [], 0, 0
    for _round in range(rounds):
        nodes.run(df.next_tasks(0.0))
        queue += df.take_batches()
        if queue and version < steps:
            b = queue.pop(0)
            served += 1
            if served == skip:
                assert df.batch_skipped("pol", b.batch_id)
            else:
                version += 1
                df.on_weights("pol", version, b.batch_id)
    return version, df.counters()["tasks.emitted"]


@pytest.mark.parametrize("skip", [2, 3, 4])
def test_a_skipped_batch_does_not_strand_tasks_emitted_ahead(skip):
    """A served batch the trainer skips (a duplicate after a restart) trains no version, so tasks
    tagged with the version it was to produce wait until a later batch produces it. A task's tag is
    the version its place in line needs, so the tasks ahead of it in line fill that batch: the run
    goes on."""
    B, eta = 2, 1
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta), _tasks(400))
    trained, _ = _train_to_the_end(df, steps=1000, skip=skip, rounds=60)
    assert trained >= 40


def test_emission_slack_keeps_versions_of_the_bound_free_for_late_groups():
    B, eta = 2, 3
    for slack in (0, 2):
        df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta,
                                     emission_slack=slack), _tasks(100))
        emitted = []
        while tasks := df.next_tasks(0.0):  # rollouts never finish: every task stays in flight
            emitted += tasks
        # the last group would be trained at version eta - slack: it may finish `slack` versions
        # late and still be trained (the ingest filter allows eta)
        assert len(emitted) == (eta - slack + 1) * B


def test_emission_slack_cannot_exceed_the_bound():
    with pytest.raises(ValidationError, match="emission_slack"):
        DataflowConfig(max_staleness=1, emission_slack=2)


def test_group_finishing_behind_a_queue_is_measured_against_its_training_version():
    B, eta = 1, 1
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta), _tasks(10))
    a, b = df.next_tasks(0.0)  # both at v0: trained at v0 and v1 in emission order
    df.ingest(_rollout(b, 0))  # b overtakes a (long tail on a)
    assert len(df.take_batches()) == 1  # b -> batch 0, trained at v0
    df.on_weights("pol", 1)
    (c,) = df.next_tasks(0.0)  # room for one more: trained at v1... or later
    df.ingest(_rollout(c, 1))  # c -> batch 1 (trained at v1)
    assert len(df.take_batches()) == 1
    # a finishes last: it would be batch 2, trained at v2 while its tokens are v0 -> stale (> eta)
    assert df.train_version("pol") == 2
    df.ingest(_rollout(a, 0))
    assert df.counters()["trajectories.stale"] == 2 and df.take_batches() == []


def test_route_pools_sends_each_task_to_the_pool_with_most_free_slots():
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=2, max_staleness=3,
                                 route_pools={"fast": 4, "slow": 2}), _tasks(40))
    first = df.next_tasks(0.0)
    assert [t.pool for t in first].count("fast") > [t.pool for t in first].count("slow") > 0
    fast_done = [t for t in first if t.pool == "fast"][:3]
    for t in fast_done:  # the fast pool finishes first: it gets the next tasks
        df.ingest(_rollout(t, 0))
    assert len(df.take_batches()) == 1
    df.on_weights("pol", 1)  # room for more under the staleness bound
    nxt = df.next_tasks(0.0)
    assert nxt and {t.pool for t in nxt} == {"fast"}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_run_emits_no_task_beyond_its_last_batch(mode):
    """Told the trainer's step count, the dataflow emits the groups of the batches the trainer will
    train, and in async mode one batch's worth of spares for the last batches; without it, the
    pipeline's overhang (max_staleness batches ahead in async mode, the next wave in sync mode) is
    generated and thrown away when the run ends."""
    B, steps = 2, 5
    eta, spare = (3, B) if mode == "async" else (0, 0)  # a sync wave is one batch: no room for spares
    cfg = DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=eta, mode=mode)
    assert _train_to_the_end(Dataflow(cfg, _tasks(100), train_steps=steps), steps) == (steps, steps * B + spare)
    trained, emitted = _train_to_the_end(Dataflow(cfg, _tasks(100)), steps)
    assert trained == steps and emitted >= (steps + max(eta, 1)) * B > steps * B + spare


def test_a_skipped_batch_or_a_dropped_group_gives_its_room_back_to_the_end_of_the_run():
    B, steps = 2, 5
    cfg = DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=1)
    # a skipped batch trains no step: one more batch is made for the run to reach its steps (and a spare)
    assert _train_to_the_end(Dataflow(cfg, _tasks(100), train_steps=steps), steps, skip=2) == (steps, (steps + 2) * B)
    # a group dropped (here: a rollout the ingest refuses as stale) frees its place for another task
    df = Dataflow(cfg, _tasks(100), train_steps=1)
    first = df.next_tasks(0.0)
    assert len(first) == 2 * B and df.next_tasks(0.0) == []  # the one batch and its spares
    df.on_weights("pol", 3)  # the trainer moved on (another dataflow's batches): v0 tokens are stale
    df.ingest(_rollout(first[0], 0))
    assert df.counters()["trajectories.stale"] == 2 and len(df.next_tasks(0.0)) == 1


def test_batches_lost_with_the_log_are_made_again_before_the_run_ends():
    B = 2
    df = Dataflow(DataflowConfig(policies=["pol"], groups_per_batch=B, max_staleness=1), _tasks(100), train_steps=2)
    nodes = _Nodes(df)
    nodes.run(df.next_tasks(0.0))
    assert len(df.take_batches()) == 2 and df.next_tasks(0.0) == []  # both batches served, none trained
    df.batches_lost("pol", 0)  # the broker lost the batch topic before the trainer read them
    assert df.counters()["batches.pol.lost_untrained"] == 2
    nodes.run(df.next_tasks(0.0))
    assert len(df.take_batches()) == 2
