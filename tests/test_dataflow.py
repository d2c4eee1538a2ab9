"""Dataflow logic (no broker): plug-ins, emitter, processor, batcher, autoscaler, checkpoints."""

from __future__ import annotations

import json

import pytest
from dataflow_helpers import cfg, dataset, rollout, traj, varied

from astraflow.dataflow import Dataflow, DataflowConfig, Group, target_nodes
from astraflow.dataflow.autoscaler import AutoscaleConfig, autoscale_report
from astraflow.dataflow.plugins import PluginError, build_plugin, registered
from astraflow.records import Task


# -- plug-in registry -------------------------------------------------------------------------
def test_registry_builds_by_name_and_fails_fast():
    assert {"accept_all", "greso", "curriculum"} <= set(registered("selector"))
    assert {"keep_all", "dynamic_sampling"} <= set(registered("filter"))
    assert {"fifo", "replay", "mixing"} <= set(registered("sampler"))
    assert build_plugin("sampler", {"type": "replay", "options": {"replay_ratio": 0.5}}).options.replay_ratio == 0.5
    with pytest.raises(PluginError, match="unknown selector plug-in 'gresso'"):
        build_plugin("selector", "gresso")
    with pytest.raises(PluginError, match="invalid options"):
        build_plugin("selector", {"type": "greso", "options": {"explore": 0.1}})


# -- emitter ----------------------------------------------------------------------------------
def test_backpressure_bounds_in_flight_and_tags_version():
    # max_in_flight: the plain in-flight cap (the staleness bound is pinned in test_scheduling_modes_units)
    df = Dataflow(cfg(groups_per_batch=3, max_staleness=1, max_in_flight=6), dataset(50))
    df.on_weights("solver", 4)
    first = df.next_tasks(0.0)
    assert len(first) == 6 == df.cfg.in_flight_cap  # 3 x (1 + 1)
    assert all(t.emitted_version == 4 for t in first)
    assert df.next_tasks(0.0) == []
    df.ingest(rollout(first[0], "solver", varied(4), version=4))
    assert [t.prompt_id for t in df.next_tasks(0.0)] == ["p6"]
    assert len(df.emitter.in_flight) == 6
    assert DataflowConfig(max_in_flight=2).in_flight_cap == 2


def test_emitter_epochs_make_ids_unique_and_resume_position():
    df = Dataflow(cfg(max_in_flight=100, epochs=2, candidate_pool=1), dataset(3))
    ids = [t.prompt_id for t in df.next_tasks(0.0)]
    assert ids == ["p0", "p1", "p2", "p0~e1", "p1~e1", "p2~e1"]
    assert df.emitter.exhausted


def test_expiry_counts_and_frees_capacity():
    df = Dataflow(cfg(groups_per_batch=1, max_staleness=0, task_timeout_s=10), dataset(5))
    (t,) = df.next_tasks(0.0)
    df.ingest(rollout(t, "solver", [1.0, 0.0])[:1] )  # half a group, then the node dies
    assert df.expire(5.0) == []
    assert [x.prompt_id for x in df.expire(11.0)] == ["p0"]
    c = df.counters()
    assert c["tasks.expired"] == 1 and c["trajectories.expired"] == 1 and c["trajectories.pending"] == 0
    df.ingest(rollout(t, "solver", [1.0, 0.0, 1.0, 0.0])[1:2])  # late arrival
    assert df.counters()["trajectories.unknown_task"] == 1
    assert len(df.next_tasks(12.0)) == 1


# -- processor --------------------------------------------------------------------------------
def test_dedup_trains_duplicate_once():
    df = Dataflow(cfg(groups_per_batch=1), dataset(2))
    (t, _) = df.next_tasks(0.0)
    trajs = rollout(t, "solver", varied(4))
    df.ingest(trajs[:2] + [trajs[1]] + trajs[2:] + [trajs[0]])
    (batch,) = df.take_batches()
    assert [x.sample_index for x in batch.trajectories] == [0, 1, 2, 3]
    c = df.counters()
    assert c["trajectories.duplicate"] == 2 and c["trajectories.kept"] == 4
    assert df.processor.unaccounted() == 0


def test_dedup_seen_set_is_bounded():
    df = Dataflow(cfg(dedup_capacity=3, groups_per_batch=10, max_in_flight=10), dataset(10, samples=2))
    tasks = df.next_tasks(0.0)
    for t in tasks[:4]:
        df.ingest(rollout(t, "solver", [0.0, 1.0]))
    assert len(df.processor.seen) == 3


def test_stale_trajectory_dropped_and_counted():
    df = Dataflow(cfg(groups_per_batch=1, max_staleness=1, min_group_samples=2), dataset(2, samples=3))
    t, _ = df.next_tasks(0.0)
    df.on_weights("solver", 3)
    df.ingest([traj(t, "solver", 0, 1.0, version=1)])  # 3 - 1 > 1: stale
    df.ingest([traj(t, "solver", 1, 1.0, version=2), traj(t, "solver", 2, 0.0, version=3)])
    (batch,) = df.take_batches()
    assert [x.sample_index for x in batch.trajectories] == [1, 2]
    assert df.counters()["trajectories.stale"] == 1
    assert df.processor.unaccounted() == 0
    assert "p0" not in df.emitter.in_flight  # the stale sample still finished the group


def test_stale_tokens_mask_trains_the_fresh_tail_of_a_rollout_continued_under_newer_weights():
    def continued(task, i, versions, mask=None):
        t = traj(task, "solver", i, float(i % 2), n=len(versions))
        t.versions, t.logprobs = list(versions), [-0.5 - k for k in range(len(versions))]
        t.loss_mask = list(mask or [1] * len(versions))
        return t

    for mode in ("drop", "mask"):
        df = Dataflow(cfg(groups_per_batch=1, max_staleness=1, stale_tokens=mode), dataset(1, samples=3))
        t = df.next_tasks(0.0)[0]
        df.on_weights("solver", 3)
        df.ingest([
            continued(t, 0, [1, 1, 2, 3, 3]),  # refreshed twice mid-episode: the first two tokens are stale
            continued(t, 1, [1, 1, 1, 2, 2], mask=[1, 1, 0, 1, 1]),  # a tool token (mask 0) stays 0
            continued(t, 2, [1, 1, 1]),  # nothing fresh: dropped in either mode
        ])
        c = df.counters()
        assert c["trajectories.stale"] == (3 if mode == "drop" else 1)
        assert df.processor.unaccounted() == 0
        if mode == "drop":
            assert df.take_batches() == []
            continue
        (batch,) = df.take_batches()
        a, b = batch.trajectories
        assert a.loss_mask == [0, 0, 1, 1, 1] and a.logprobs == [0.0, 0.0, -2.5, -3.5, -4.5]
        assert b.loss_mask == [0, 0, 0, 1, 1] and b.versions == [1, 1, 1, 2, 2]  # versions are kept as produced
        assert 3 - min(x.min_version for x in batch.trajectories) <= 1  # every trained token within the bound
        assert c["trajectories.partly_stale"] == 2 and c["trajectories.stale_tokens_masked"] == 4


def test_dynamic_sampling_drops_zero_variance_groups():
    df = Dataflow(cfg(groups_per_batch=1, filters=[{"type": "dynamic_sampling"}]), dataset(3))
    a, b = df.next_tasks(0.0)
    df.ingest(rollout(a, "solver", [1.0] * 4) + rollout(b, "solver", [0.0, 1.0, 1.0, 0.5]))
    batches = df.take_batches()
    assert [x.batch_id for x in batches] == ["solver-00000000"]
    assert {x.task_id for x in batches[0].trajectories} == {"p1"}
    c = df.counters()
    assert c["trajectories.groups_dropped:filter:dynamic_sampling"] == 1
    assert c["trajectories.in_dropped_group"] == 4
    assert c["tasks.finished"] == 2 and c["tasks.in_flight"] == 0


def test_routing_to_two_policies():
    df = Dataflow(cfg(policies=["solver", "verifier"], groups_per_batch=1), dataset(2))
    t, u = df.next_tasks(0.0)
    assert df.emitter.in_flight["p0"].pending_policies == {"solver", "verifier"}
    df.ingest(rollout(t, "solver", varied(4)))
    assert "p0" in df.emitter.in_flight  # verifier group still owed
    df.ingest(rollout(t, "verifier", varied(4)))
    assert "p0" not in df.emitter.in_flight
    batches = {b.policy: b for b in df.take_batches()}
    assert set(batches) == {"solver", "verifier"}
    assert all(x.policy == "verifier" for x in batches["verifier"].trajectories)
    df.ingest(rollout(u, "critic", varied(4)))
    assert df.counters()["trajectories.unknown_policy"] == 4


# -- batcher ----------------------------------------------------------------------------------
def test_batch_sizes_and_group_contiguity():
    df = Dataflow(cfg(groups_per_batch=3, max_in_flight=10), dataset(10))
    tasks = df.next_tasks(0.0)
    for t in tasks[:7]:
        df.ingest(rollout(t, "solver", varied(4)))
    batches = df.take_batches()
    assert [len(b.groups()) for b in batches] == [3, 3]
    assert [len(b.trajectories) for b in batches] == [12, 12]
    assert batches[0].trajectories[0].task_id == "p0" and batches[1].batch_id == "solver-00000001"
    assert df.counters()["batches.solver.groups_buffered"] == 1


def test_replay_ratio():
    df = Dataflow(cfg(groups_per_batch=4, max_in_flight=40,
                      sampler={"type": "replay", "options": {"replay_ratio": 0.25}}), dataset(40, samples=2))
    tasks = df.next_tasks(0.0)
    for t in tasks[:4 + 3 * 3]:
        df.ingest(rollout(t, "solver", [0.0, 1.0]))
    batches = df.take_batches()
    assert len(batches) == 4
    assert all(len(b.groups()) == 4 for b in batches)
    c = df.counters()
    # first batch all fresh (nothing to replay yet), then 3 fresh + 1 replayed each
    assert c["batches.solver.groups_replayed"] == 3 and c["batches.solver.groups_batched"] == 13
    fresh_ids = [set(b.groups()) for b in batches]
    assert len(fresh_ids[1] & fresh_ids[0]) == 1


def test_mixing_by_task_type():
    sampler = build_plugin("sampler", {"type": "mixing", "options": {"weights": {"a": 3, "b": 1}}})
    for i in range(8):
        sampler.add(Group(f"ga{i}", f"a{i}", "s", "a", 1))
        sampler.add(Group(f"gb{i}", f"b{i}", "s", "b", 1))
    got = sampler.sample(4)
    assert [g.task_type for g in got] == ["a", "a", "a", "b"]


# -- selectors --------------------------------------------------------------------------------
def test_greso_skips_zero_variance_prompts_with_recheck_and_state_round_trip():
    g = build_plugin("selector", {"type": "greso", "options": {"explore_prob": 0.2, "seed": 1}})
    tasks = dataset(200)
    for t in tasks[:100]:
        g.observe(t, "solver", [1.0] * 4)  # solved every time: no signal
    for t in tasks[100:]:
        g.observe(t, "solver", [0.0, 1.0, 1.0, 1.0])
    g2 = build_plugin("selector", {"type": "greso", "options": {"explore_prob": 0.2, "seed": 999}})
    g2.load_state_dict(json.loads(json.dumps(g.state_dict())))
    emit, skip = g.select(tasks, 200)
    assert {t.prompt_id for t in tasks[100:]} <= {t.prompt_id for t in emit}
    assert all(int(t.prompt_id[1:]) < 100 for t in skip)
    assert 60 <= len(skip) <= 95  # ~80 skipped, ~20 re-checked
    _emit2, skip2 = g2.select(tasks, 200)
    assert [t.prompt_id for t in skip2] == [t.prompt_id for t in skip]


def test_greso_in_dataflow_counts_skips():
    # max_in_flight: a plain cap, since no trainer advances the version here (the staleness bound
    # would rightly stop emission after the first buffered group)
    df = Dataflow(cfg(groups_per_batch=1, max_staleness=0, epochs=3, candidate_pool=1, max_in_flight=1,
                      selector={"type": "greso", "options": {"explore_prob": 0.0}}), dataset(2))
    for _ in range(2):
        (t,) = df.next_tasks(0.0)
        df.ingest(rollout(t, "solver", [1.0] * 4 if t.metadata["source_prompt_id"] == "p0" else varied(4)))
    ids = []
    while (ts := df.next_tasks(0.0)):
        ids += [t.prompt_id for t in ts]
        df.ingest(rollout(ts[0], "solver", varied(4)))
    assert ids == ["p1~e1", "p1~e2"]
    assert df.counters()["tasks.selector_skipped"] == 2


def test_curriculum_prefers_levels_near_target_pass_rate():
    c = build_plugin("selector", {"type": "curriculum", "options": {"target_pass_rate": 0.5}})
    tasks = [Task(f"p{i}", "q", metadata={"difficulty": str(i % 3)}) for i in range(9)]
    assert [t.metadata["difficulty"] for t in c.select(tasks, 3)[0]] == ["0", "0", "0"]  # prior: start easy
    c.observe(tasks[0], "s", [1.0] * 4)        # level 0 solved
    c.observe(tasks[1], "s", [1.0, 0.0, 1.0, 0.0])  # level 1 at target
    c.observe(tasks[2], "s", [0.0] * 4)        # level 2 too hard
    assert [t.metadata["difficulty"] for t in c.select(tasks, 3)[0]] == ["1", "1", "1"]
    c2 = build_plugin("selector", "curriculum")
    c2.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert c2.select(tasks, 9)[0] == c.select(tasks, 9)[0]


# -- sync mode ----------------------------------------------------------------------------------
def test_sync_mode_emits_one_wave_per_version_and_tops_up_after_filters():
    df = Dataflow(cfg(mode="sync", groups_per_batch=2, filters=["dynamic_sampling"]), dataset(20))
    wave = df.next_tasks(0.0)
    assert len(wave) == 2 and df.next_tasks(0.0) == []
    df.ingest(rollout(wave[0], "solver", varied(4)))
    assert df.next_tasks(0.0) == []  # wave not finished
    df.ingest(rollout(wave[1], "solver", [1.0] * 4))  # dropped by dynamic sampling
    assert df.take_batches() == []
    topup = df.next_tasks(0.0)
    assert len(topup) == 1 and topup[0].emitted_version == 0
    df.ingest(rollout(topup[0], "solver", varied(4)))
    assert len(df.take_batches()) == 1
    assert df.next_tasks(0.0) == []  # barrier: no new weights yet
    df.on_weights("solver", 1)
    nxt = df.next_tasks(0.0)
    assert len(nxt) == 2 and all(t.emitted_version == 1 for t in nxt)


# -- autoscaler ---------------------------------------------------------------------------------
def test_autoscaler_math():
    a = AutoscaleConfig()
    assert target_nodes(a, 4, wait_s=5, step_s=10, consumed=0, entered=0)[::2] == (8, "trainer_starved")
    assert target_nodes(a, 4, wait_s=0.7, step_s=10, consumed=10, entered=10)[0] == 4  # w=0.07 in band
    assert target_nodes(a, 10, wait_s=0, step_s=10, consumed=50, entered=100) == (6, 0.0, "rollout_surplus")
    assert target_nodes(a, 2, wait_s=0, step_s=10, consumed=100, entered=100)[0] == 2  # never grows below band
    assert target_nodes(a, 4, wait_s=100, step_s=10, consumed=0, entered=0)[0] == 40  # w clipped at 0.9
    assert target_nodes(AutoscaleConfig(max_nodes=6), 4, 5, 10, 0, 0)[0] == 6
    rep = autoscale_report(a, {"gpu": {"nodes": 3, "wait_s": 2, "step_s": 10, "consumed": 1, "entered": 1}}, 1.0)
    assert rep.pools["gpu"].model_dump() == {"nodes": 3, "target_nodes": 4, "w": 0.2, "reason": "trainer_starved"}


# -- checkpoint / restore -----------------------------------------------------------------------
def test_checkpoint_restore_loses_nothing():
    """Run, checkpoint mid-flight (partial groups, buffered groups, replay, GRESO history), restore
    into a fresh Dataflow through JSON, feed the same remaining input to both: identical outputs."""
    recipe = cfg(groups_per_batch=2, max_in_flight=8, epochs=2,
                 selector={"type": "greso", "options": {"explore_prob": 0.5}},
                 filters=["dynamic_sampling"], sampler={"type": "replay", "options": {"replay_ratio": 0.5}})
    a = Dataflow(recipe, dataset(6))
    tasks = a.next_tasks(0.0)
    a.ingest(rollout(tasks[0], "solver", [1.0] * 4))
    for t in tasks[1:4]:
        a.ingest(rollout(t, "solver", varied(4)))
    a.ingest(rollout(tasks[4], "solver", varied(4))[:2])  # partial group
    a.take_batches()
    state = json.loads(json.dumps(a.state_dict()))
    b = Dataflow(recipe, dataset(6))
    b.load_state_dict(state)
    assert b.counters() == a.counters()

    def drive(df: Dataflow) -> list:
        out = []
        df.ingest(rollout(tasks[4], "solver", varied(4)))  # redelivered in full after restart
        for t in tasks[5:]:
            df.ingest(rollout(t, "solver", varied(4)))
        for _ in range(6):
            ts = df.next_tasks(1.0)
            for t in ts:
                df.ingest(rollout(t, "solver", varied(4) if t.prompt_id != "p5" else [0.0] * 4))
            out.append([t.prompt_id for t in ts])
            out += [(x.batch_id, [t.episode_id for t in x.trajectories]) for x in df.take_batches()]
        return out

    assert drive(a) == drive(b)
    assert a.counters() == b.counters()
    assert b.counters()["trajectories.duplicate"] == 2
    assert b.processor.unaccounted() == 0
    assert b.finished and not a.emitter.in_flight
    c = b.counters()
    assert c["tasks.emitted"] == c["tasks.finished"] == 12 - c["tasks.selector_skipped"]


def test_batch_lookahead_serves_batches_as_the_trainer_advances():
    df = Dataflow(cfg(groups_per_batch=1, max_in_flight=3, batch_lookahead=1), dataset(3, samples=2))
    for t in df.next_tasks(0.0):
        df.ingest(rollout(t, "solver", [0.0, 1.0]))
    assert len(df.take_batches()) == 1  # one untrained batch ahead of the trainer, two groups wait
    assert df.take_batches() == [] and df.counters()["batches.solver.groups_buffered"] == 2
    df.on_weights("solver", 1)  # the trainer trained batch 0
    assert [b.batch_id for b in df.take_batches()] == ["solver-00000001"]
    assert Dataflow(cfg(groups_per_batch=1, max_in_flight=3), dataset(1)).cfg.batch_lookahead is None


def test_oldest_first_serves_the_oldest_tokens_first_and_the_staleness_rule_knows_it():
    df = Dataflow(cfg(groups_per_batch=1, max_staleness=1, max_in_flight=4, batch_lookahead=1,
                      sampler="oldest_first"), dataset(4, samples=2))
    tasks = df.next_tasks(0.0)
    df.on_weights("solver", 2)
    for t, v in zip(tasks[:3], (2, 3, 2), strict=True):
        df.ingest(rollout(t, "solver", [0.0, 1.0], version=v))
    first = df.take_batches()  # lookahead 1: one batch now, the other two wait in the sampler
    assert [b.trajectories[0].versions[0] for b in first] == [2]
    # a group of version 1 finishing late goes before the version-3 group
    sampler = df.batchers["solver"].sampler
    assert sampler.ahead_of(1) == 0 and sampler.ahead_of(2) == 1 and sampler.ahead_of(3) == 2
    fifo = Dataflow(cfg(groups_per_batch=1), dataset(1)).batchers["solver"].sampler
    assert fifo.ahead_of(0) == fifo.buffered()
    df.ingest(rollout(tasks[3], "solver", [1.0, 0.0], version=1))
    again = Dataflow(df.cfg, dataset(4, samples=2))  # the waiting groups and their order survive a restart
    again.load_state_dict(json.loads(json.dumps(df.state_dict())))
    assert again.batchers["solver"].sampler.buffered() == sampler.buffered() == 3
    assert [g.min_version for g in again.batchers["solver"].sampler.drain()] == [1, 2, 3]
    versions = []
    for v in (3, 4, 5):
        df.on_weights("solver", v)
        versions += [b.trajectories[0].versions[0] for b in df.take_batches()]
    assert versions == [1, 2, 3]
    assert df.processor.unaccounted() == 0
