"""The rules of resuming onto a log that lost records (no broker: the real-log path is in
test_dataflow_service.py): which in-flight tasks are lost, re-emission, adoption of tasks sent after the
saved state, staleness re-basing."""

from __future__ import annotations

import json

import pytest

from astraflow.dataflow import Dataflow, DataflowConfig
from astraflow.dataflow.emitter import InFlight
from astraflow.dataflow.recovery import lost_tasks
from astraflow.log.identity import recreated_topics
from astraflow.records import Task, Trajectory, episode_id_for, group_id_for


def _tasks(n: int) -> list[Task]:
    return [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(n)]


def test_recreated_topics_judges_only_known_ids():
    saved = {"r.tasks.a": "id-1", "r.tasks.b": "id-2", "r.trajectories": None}
    now = {"r.tasks.a": "id-1", "r.tasks.b": "id-9", "r.trajectories": "id-3"}
    assert recreated_topics(saved, now) == {"r.tasks.b"}
    assert recreated_topics({"r.tasks.a": "id-1"}, {"r.tasks.a": None}) == set()  # broker without ids


def test_lost_tasks_by_recreated_topic_retention_or_unknown_position():
    t = _tasks(5)
    in_flight = {
        "p0": InFlight(t[0], 0.0, {"s"}, ("r.tasks.a", 0, 7)),   # standing
        "p1": InFlight(t[1], 0.0, {"s"}, ("r.tasks.a", 1, 2)),   # below earliest (retention)
        "p2": InFlight(t[2], 0.0, {"s"}, ("r.tasks.b", 0, 9)),   # its topic was re-created
        "p3": InFlight(t[3], 0.0, {"s"}, None),                   # no position, topic standing
        "p4": InFlight(Task("p4", "q", pool="b"), 0.0, {"s"}, None),  # no position, topic re-created
    }
    lost = lost_tasks(in_flight, lambda task: f"r.tasks.{task.pool if task.pool != 'default' else 'a'}",
                      {"r.tasks.b"}, {("r.tasks.a", 0): 0, ("r.tasks.a", 1): 5})
    assert sorted(lost) == ["p1", "p2", "p4"]


def test_reemit_keeps_the_task_in_flight_restarts_its_clock_and_counts():
    df = Dataflow(DataflowConfig(policies=["s"], groups_per_batch=2, max_in_flight=2), _tasks(4))
    sent = df.next_tasks(now=100.0)
    df.emitter.placed("p0", ("r.tasks.default", 0, 0))
    df.emitter.placed("p1", ("r.tasks.default", 1, 0))
    state = json.loads(json.dumps(df.state_dict()))  # positions survive the checkpoint
    df2 = Dataflow(DataflowConfig(policies=["s"], groups_per_batch=2, max_in_flight=2), _tasks(4))
    df2.load_state_dict(state)
    assert df2.emitter.in_flight["p1"].position == ("r.tasks.default", 1, 0)
    again = df2.emitter.reemit(["p1", "gone"], now=5000.0)
    assert again == [sent[1]] and df2.counters()["tasks.reemitted_lost"] == 1
    f = df2.emitter.in_flight["p1"]
    assert (f.emitted_at, f.position, f.pending_policies) == (5000.0, None, {"s"})
    assert df2.next_tasks(now=5000.0) == []  # still in flight: the cap holds, nothing new drawn
    # 900 s timeout: p0 (emitted at t=100) expires at t=5899, p1's clock restarted at its re-emission
    assert [t.prompt_id for t in df2.expire(now=5000.0 + 899)] == ["p0"]


def test_an_adopted_task_is_in_flight_and_never_drawn_again_across_a_save():
    """Tasks a lost life sent after the saved state: one still among the saved candidates, one drawn
    beyond the saved cursor. Adopted, both are in flight as sent; neither is drawn again, even after
    another save and restore; the accounting emitted = finished + in flight holds."""
    cfg = DataflowConfig(policies=["s"], groups_per_batch=2, max_in_flight=2, candidate_pool=4)
    df = Dataflow(cfg, _tasks(6))
    assert [t.prompt_id for t in df.next_tasks(now=1.0)] == ["p0", "p1"]
    state = json.loads(json.dumps(df.state_dict()))  # the lost life's last save: p2, p3 are candidates
    df2 = Dataflow(cfg, _tasks(6))
    df2.load_state_dict(state)
    sent = [Task("p2", "q2", answer="2", samples=2, emitted_version=3), Task("p4", "q4", answer="4", samples=2)]
    assert df2.emitter.adopt(sent[0], ("r.tasks.default", 1, 7), now=2.0)
    assert df2.emitter.adopt(sent[1], ("r.tasks.default", 2, 9), now=2.0)
    assert not df2.emitter.adopt(Task("p1", "q1"), ("r.tasks.default", 0, 8), now=2.0)  # already in flight
    assert [t.prompt_id for t in df2.emitter.candidates] == ["p3"] and df2.emitter.adopted == {"p4"}
    assert df2.emitter.in_flight["p2"].task.emitted_version == 3  # as the record says
    assert df2.emitter.in_flight["p4"].position == ("r.tasks.default", 2, 9)
    for t in (df2.emitter.task("p0"), df2.emitter.task("p1"), sent[0], sent[1]):
        df2.emitter.group_done(t.prompt_id, "s")
    df3 = Dataflow(cfg, _tasks(6))
    df3.load_state_dict(json.loads(json.dumps(df2.state_dict())))
    assert [t.prompt_id for t in df3.next_tasks(now=3.0)] == ["p3", "p5"]  # p2 and p4 skipped
    c = df3.counters()
    assert c["tasks.adopted"] == 2 and c["tasks.emitted"] == 6 == c["tasks.finished"] + c["tasks.in_flight"]
    assert df3.next_tasks(now=3.0) == [] and df3.emitter.adopted == set()


def _finish(df: Dataflow, task: Task, version: int) -> None:
    df.ingest(Trajectory(
        episode_id=episode_id_for(task.prompt_id, "s", i), task_id=task.prompt_id,
        group_id=group_id_for(task.prompt_id, "s"), sample_index=i, policy="s", prompt_ids=[1],
        response_ids=[5], logprobs=[-1.0], versions=[version], loss_mask=[1], reward=float(i))
        for i in range(task.samples))


def test_lost_batches_rebase_the_staleness_room():
    """Two batches served, neither trained (they died with the log): without re-basing, the
    emitter waits for the versions those batches were to produce; re-based, it emits again. (Without
    emit_ahead, which would send one task ahead for v1: test_scheduling_modes_units covers it.)"""
    df = Dataflow(DataflowConfig(policies=["s"], groups_per_batch=1, max_staleness=1, emit_ahead=False),
                  _tasks(10))
    for t in df.next_tasks(now=0.0):
        _finish(df, t, 0)
    assert len(df.take_batches()) == 2
    assert df.next_tasks(now=0.0) == []  # 2 batches out, v0 announced: no room
    df.batches_lost("s", 0)
    assert len(df.next_tasks(now=0.0)) == 2  # (max_staleness + 1) * groups_per_batch


def _rollout(task: Task, version: int = 0) -> list[Trajectory]:
    return [Trajectory(
        episode_id=episode_id_for(task.prompt_id, "s", i), task_id=task.prompt_id,
        group_id=group_id_for(task.prompt_id, "s"), sample_index=i, policy="s", prompt_ids=[1],
        response_ids=[5], logprobs=[-1.0], versions=[version], loss_mask=[1], reward=float(i))
        for i in range(task.samples)]


def test_restart_from_checkpoint_rereads_trajectories_of_tasks_emitted_after_it():
    """SIGKILL, same log: the lost life emitted p2 after the checkpoint and p2's trajectories are on the
    log. The restarted dataflow reads them before it emits p2 again (its cap is still full with p0,
    p1): they count as unknown_task, and must not make the re-run's trajectories duplicates."""
    section = DataflowConfig(policies=["s"], groups_per_batch=1, max_in_flight=2, min_group_samples=1)
    life1 = Dataflow(section, _tasks(6))
    p0, _ = life1.next_tasks(now=0.0)
    checkpoint = json.loads(json.dumps(life1.state_dict()))
    life1.ingest(_rollout(p0))
    (p2,) = life1.next_tasks(now=1.0)  # emitted after the checkpoint; then the process is killed

    life2 = Dataflow(section, _tasks(6))
    life2.load_state_dict(checkpoint)
    life2.ingest(_rollout(p0) + _rollout(p2))  # one poll re-reads both from the checkpointed offset
    c = life2.counters()
    assert c["tasks.finished"] == 1 and c["trajectories.unknown_task"] == 2
    again = life2.next_tasks(now=2.0)
    assert p2.prompt_id in [t.prompt_id for t in again]  # drawn again: same dataset position
    life2.ingest(_rollout(p2))  # the re-run: same episode ids
    c = life2.counters()
    assert c["tasks.finished"] == 2 and c.get("trajectories.duplicate", 0) == 0 and c["trajectories.kept"] == 4


def _lost_life_after_a_save(sampler: dict) -> tuple[dict, list, list[Task], DataflowConfig]:
    """A life that served batch 0 (p3, p4, p5), saved its state with p1 buffered and half of p0 pending,
    then finished p0 and p2 and served batch 1 before it was killed: (the save, its batches after the
    save, the tasks, the config)."""
    section = DataflowConfig(policies=["s"], groups_per_batch=3, max_in_flight=9, min_group_samples=1,
                             sampler=sampler)
    life = Dataflow(section, _tasks(9))
    t = life.next_tasks(now=0.0)
    life.ingest(_rollout(t[3]) + _rollout(t[4]) + _rollout(t[5]))
    assert [b.batch_id for b in life.take_batches()] == ["s-00000000"]
    life.ingest(_rollout(t[1]) + _rollout(t[0])[:1])  # p1 buffered, p0 pending
    save = json.loads(json.dumps(life.state_dict()))
    life.ingest(_rollout(t[0])[1:] + _rollout(t[2]))
    return save, life.take_batches(), t, section


@pytest.mark.parametrize("sampler", ["fifo", "oldest_first", "mixing"])
def test_an_adopted_batch_is_served_once_its_groups_leave_the_buffers_and_is_received_once(sampler):
    """Adopted, the lost life's batch 1 (p0: half pending in the save, p1: buffered in the save, p2: new)
    finishes the three tasks and empties the buffers of those groups; the records the lost life received
    after the save, read again from the saved offsets, are not received a second time (the log holds
    them once: an archive's replay counts them once), further copies are duplicates; the next batch is
    number 2, and every trajectory is in exactly one counter."""
    save, (lost,), t, section = _lost_life_after_a_save({"type": sampler})
    assert lost.batch_id == "s-00000001" and {x.task_id for x in lost.trajectories} == {"p0", "p1", "p2"}
    life2 = Dataflow(section, _tasks(9))
    life2.load_state_dict(save)
    assert life2.adopt_batch(lost) and not life2.adopt_batch(lost)  # a batch is adopted once
    assert life2.batchers["s"].sampler.buffered() == 0 and life2.processor.pending == {}
    assert not {"p0", "p1", "p2"} & set(life2.emitter.in_flight)
    received = life2.counters()["trajectories.received"]
    life2.ingest(_rollout(t[0])[1:] + _rollout(t[2]))  # read again from the saved offsets
    assert life2.counters()["trajectories.received"] == received
    assert life2.counters()["trajectories.adopted_read_again"] == 3
    life2.ingest(_rollout(t[0]) + _rollout(t[1]) + _rollout(t[2]))  # copies beyond: a node's re-run
    life2.ingest(_rollout(t[3])[:1] + _rollout(t[6]) + _rollout(t[7]) + _rollout(t[8]))
    (after,) = life2.take_batches()
    assert after.batch_id == "s-00000002" and {x.task_id for x in after.trajectories} == {"p6", "p7", "p8"}
    c = life2.counters()
    assert c["trajectories.duplicate"] == 6 + 1  # p0, p1 and p2 again, and a sample of p3 (batch 0)
    assert c["batches.s.batches"] == 3 and c["batches.s.groups_batched"] == 9
    assert c["trajectories.groups_finished"] == c["trajectories.groups_kept"] == 9
    assert life2.processor.unaccounted() == 0
    assert c["tasks.finished"] == 9 and c["tasks.in_flight"] == 0


def test_an_adopted_batch_with_a_replayed_group_counts_it_as_replayed():
    """With the replay sampler the lost life's batch 1 holds two fresh groups and one trained before
    (batch 0): adopted, the replayed group is counted as such and finishes nothing; the fresh ones as
    above; p2, which the lost life left buffered, is in flight until its trajectories are read again."""
    save, (lost,), _, section = _lost_life_after_a_save({"type": "replay", "options": {"replay_ratio": 0.34}})
    groups = {x.task_id for x in lost.trajectories}
    assert lost.batch_id == "s-00000001" and {"p0", "p1"} < groups and len(groups & {"p3", "p4", "p5"}) == 1
    life2 = Dataflow(section, _tasks(9))
    life2.load_state_dict(save)
    assert life2.adopt_batch(lost)
    c = life2.counters()
    assert c["batches.s.groups_replayed"] == 1 and c["batches.s.groups_batched"] == 3 + 2
    assert set(life2.emitter.in_flight) == {"p2", "p6", "p7", "p8"} and life2.processor.unaccounted() == 0


def test_batches_the_trainer_skipped_as_duplicates_give_their_versions_back():
    """A dataflow restarted from a checkpoint taken before its first batch re-serves ids 0 and 1 after
    reading announcements up to v3: the trainer trained those ids already and skips them. Each skip
    gives back the version the staleness bound was waiting for; a skip of a batch this state never
    served (or another policy's) changes nothing. (Without emit_ahead, as above.)"""
    df = Dataflow(DataflowConfig(policies=["s"], groups_per_batch=1, max_staleness=1, emit_ahead=False),
                  _tasks(20))
    df.on_weights("s", 3)
    for t in df.next_tasks(now=0.0):
        df.ingest(_rollout(t, version=3))
    assert [b.batch_id for b in df.take_batches()] == ["s-00000000", "s-00000001"]
    assert df.next_tasks(now=0.0) == []  # waiting for v4, v5, which the skipped batches will not produce
    assert not df.batch_skipped("s", "s-00000002") and not df.batch_skipped("other", "s-00000000")
    assert df.batch_skipped("s", "s-00000000") and df.batch_skipped("s", "s-00000001")
    assert len(df.next_tasks(now=0.0)) == 2 and df.counters()["batches.s.skipped_by_trainer"] == 2


def test_sync_mode_adopting_a_wave_does_not_emit_it_twice():
    """Sync mode: the lost life emitted v0's wave after its last save. Adopted, that wave is the one for
    v0: once it finishes nothing more is emitted until v1 is announced, as in the lost life."""
    section = DataflowConfig(policies=["s"], groups_per_batch=2, mode="sync", min_group_samples=1)
    life1 = Dataflow(section, _tasks(8))
    save = json.loads(json.dumps(life1.state_dict()))  # before the first wave
    wave = life1.next_tasks(now=0.0)
    assert len(wave) == 2 and life1.next_tasks(now=0.0) == []

    life2 = Dataflow(section, _tasks(8))
    life2.load_state_dict(save)
    for i, t in enumerate(wave):
        assert life2.emitter.adopt(t, ("r.tasks.default", i, 0), now=1.0)
    for t in wave:
        life2.ingest(_rollout(t))
    assert len(life2.take_batches()) == 1
    assert life2.next_tasks(now=2.0) == []  # v0's wave is done: wait for v1
    life2.on_weights("s", 1)
    assert [t.prompt_id for t in life2.next_tasks(now=3.0)] == ["p2", "p3"]


def test_announcements_re_anchor_the_staleness_bound_after_a_trainer_restart():
    """The i-th batch served is trained into base + i + 1, until a trainer resumes from an older
    checkpoint: it announces its checkpoint as a fresh version and trains the batches after it again,
    each into a new version. Each announcement names the last batch trained into it, which re-anchors
    the rule as the version arrives; without that the announced versions open room for as many batches'
    worth of tasks more than the trainer will take."""
    section = DataflowConfig(policies=["s"], groups_per_batch=1, max_staleness=1, emit_ahead=False,
                             min_group_samples=1)
    df = Dataflow(section, _tasks(40))
    trained = []
    while len(trained) < 4:  # batches 0..3 served, each trained into the next version
        for t in df.next_tasks(now=0.0):
            _finish(df, t, df.versions["s"])
        for b in df.take_batches():
            if len(trained) < 4:
                df.on_weights("s", df.versions["s"] + 1, b.batch_id)
                trained.append(b.batch_id)
    assert trained == [f"s-{i:08d}" for i in range(4)] and df.versions["s"] == 4
    room = df.staleness_room()
    assert room == 2
    # The trainer dies after v4 and resumes from its checkpoint after batch 1: it announces that
    # checkpoint as v5 (two batches back: their tasks' room is gone), then trains batch 2 again into v6
    # and batch 3 into v7.
    df.on_weights("s", 5, "s-00000001")
    assert df.staleness_room() == room - 2  # 3 by the count of versions alone
    df.on_weights("s", 6, "s-00000002")
    assert df.staleness_room() == room - 1
    df.on_weights("s", 7, "s-00000003")
    assert df.staleness_room() == room  # where it was at v4, not 3 batches' worth beyond
    assert not df.batch_trained("s", "s-00000099", 8) and not df.batch_trained("s", "other-00000001", 8)
