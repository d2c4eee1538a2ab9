"""Trainer component: checkpoints in the real bucket, and kill/restart on the real stack without
re-training consumed batches."""

from __future__ import annotations

import json
import signal

import pytest
from raas_support import (
    TopicReader,
    load_tiny_model,
    recipe_dict,
    send_batches,
    start_component,
    stop,
    trainer_batch,
    write_files,
)

from astraflow.records.control import (
    TRAINER_RECORDS,
    TrainerDone,
    TrainerRecord,
    TrainerSkipped,
    TrainerStart,
    TrainerStep,
)


def test_checkpoint_round_trip_and_corrupt_checkpoint_is_refused(test_cluster):
    import torch

    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointError, CheckpointStore, TrainerCheckpoint

    store = ObjectStore.from_config(test_cluster)
    ckpts = CheckpointStore(store, test_cluster.run, "policy")
    assert ckpts.load() is None
    model = load_tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pointer = ckpts.save(TrainerCheckpoint(step=4, version=5, model_state=sd, optimizer_state=opt.state_dict(),
                                           offsets={"r.batches.policy:0": 4}, batch_ids=["a", "b", "c", "d"]))
    got = ckpts.load()
    assert (got.step, got.version, got.offsets, got.batch_ids) == (4, 5, {"r.batches.policy:0": 4}, ["a", "b", "c", "d"])
    assert all(torch.equal(got.model_state[k], sd[k]) for k in sd)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(got.optimizer_state)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    # a part replaced behind the pointer's back (valid object checksum, wrong content) is refused
    store.put_bytes(pointer["parts"]["model"]["key"], b"not the weights")
    with pytest.raises(CheckpointError, match="does not match"):
        ckpts.load()


def _trainer_records(reader: TopicReader) -> list[TrainerRecord]:
    return [r for r in reader.records if isinstance(r, TRAINER_RECORDS)]


@pytest.mark.slow
@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_trainer_restart_resumes_from_checkpoint_without_retraining(test_cluster, tmp_path, kill):
    from astraflow.delta.store import WeightStore
    from astraflow.log import Topics
    from astraflow.log.range_reader import read_to_end

    cfg = test_cluster
    rd = recipe_dict(cfg.run, trainer={"steps": 6, "checkpoint_every": 2, "anchor_every": 10, "max_publish_lag": 2})
    cfg_path, recipe_path = write_files(tmp_path, cfg, rd)
    ids = [f"b{i}" for i in range(6)]
    send_batches(cfg, ids[:3])
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    args = ["trainer", "--recipe", str(recipe_path), "--policy", "policy"]
    life1 = start_component(args, cfg_path, tmp_path / "life1.log")
    life2 = None
    try:
        def steps_of(life_records):
            return [r for r in life_records if isinstance(r, TrainerStep)]

        metrics.until(lambda items: len(steps_of(_trainer_records(metrics))) >= 3, 120, "3 steps of life 1",
                      alive=lambda: life1.poll() is None or pytest.fail((tmp_path / "life1.log").read_text()))
        # The checkpoint of step 2 is written off the training loop: kill once it is in the bucket.
        _wait_for_checkpoint(cfg, 2, 60)
        assert stop(life1, kill) in (0, -9), (tmp_path / "life1.log").read_text()[-3000:]
        life1_id = steps_of(_trainer_records(metrics))[0].life
        send_batches(cfg, ids[3:])
        life2 = start_component(args, cfg_path, tmp_path / "life2.log")
        metrics.until(lambda items: any(isinstance(r, TrainerDone) for r in _trainer_records(metrics)), 120,
                      "life 2 done",
                      alive=lambda: life2.poll() is None or any(isinstance(r, TrainerDone) for r in _trainer_records(metrics))
                      or pytest.fail((tmp_path / "life2.log").read_text()))
        assert life2.wait(30) == 0, (tmp_path / "life2.log").read_text()[-3000:]
        # the JSON summary line (log lines of background threads may follow it)
        result = next(json.loads(line) for line in reversed((tmp_path / "life2.log").read_text().splitlines())
                      if line.startswith("{") and '"finished"' in line)
    finally:
        for p in (life1, life2):
            if p is not None and p.poll() is None:
                p.kill()
        metrics.read()
        metrics.close()
    records = _trainer_records(metrics)
    start2 = next(r for r in records if isinstance(r, TrainerStart) and r.life != life1_id)
    ckpt_step = start2.step
    one = [r for r in records if isinstance(r, TrainerStep) and r.life == life1_id]
    two = [r for r in records if isinstance(r, TrainerStep) and r.life == start2.life]
    assert [r.batch_id for r in one] == ids[:3]
    if kill == signal.SIGKILL:
        assert ckpt_step == 2  # the checkpoint of step 2; step 3 died with the process
    else:
        assert ckpt_step == 3  # a clean stop checkpoints what it trained
        assert not {r.batch_id for r in one} & {r.batch_id for r in two}  # nothing trained twice
    # The surviving lineage: life 1 up to its checkpoint, then life 2. Every batch exactly once.
    lineage = [r.batch_id for r in one if r.step <= ckpt_step] + [r.batch_id for r in two]
    assert lineage == ids
    assert [r.step for r in two] == list(range(ckpt_step + 1, 7))
    assert result["step"] == 6 and result["finished"]
    # versions only move forward, and the last one is in the weight store
    versions = [r.version for r in records if isinstance(r, TrainerStep)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert WeightStore.from_config(cfg, "policy").latest_version() == result["version"]
    # each announcement names the last batch in its weights, so that the dataflow counts staleness from
    # it: a step's, its batch; life 2's first version (the checkpoint, republished after a SIGKILL), the
    # checkpoint's last batch
    weights = read_to_end(cfg, {(Topics(cfg.run).weights("policy"), 0): 0}).messages
    trained_through = {m.record.version: m.record.batch_id for m in weights}  # announcements, typed at decode
    assert all(trained_through[r.version] == r.batch_id for r in records if isinstance(r, TrainerStep))
    assert trained_through[start2.version] == ids[ckpt_step - 1] and trained_through[0] is None
    for r in two:
        assert r.wait_s >= 0 and r.step_s > 0 and r.publish_bytes > 0 and r.tokens == 12
        assert 0 < r.publish_s < 60  # step end -> its version announced
        # each batch: 2 groups of rewards 0, 1 (advantage never 0), all trained on
        assert r.zero_adv_frac == 0.0 and r.trained_trajectories == r.trajectories == 4


def _wait_for_checkpoint(cfg, step: int, timeout_s: float) -> None:
    import time

    from astraflow.objstore import ObjectNotFoundError, ObjectStore, RunLayout
    from astraflow.objstore.layout import TRAINER_POINTER_FILE

    store, key = ObjectStore.from_config(cfg), RunLayout(cfg.run).trainer_key("policy", TRAINER_POINTER_FILE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if store.get_json(key)["step"] >= step:
                return
        except ObjectNotFoundError:
            pass
        time.sleep(0.1)
    pytest.fail(f"no checkpoint of step {step} within {timeout_s:g} s")


def _run_trainer_in_process(cfg, recipe, *, stop_first: bool) -> dict:
    import threading

    from astraflow.trainer.service import run_trainer

    stop_event = threading.Event()
    if stop_first:
        stop_event.set()  # bootstrap only: the loop ends before the first poll
    return run_trainer(cfg, recipe, "policy", stop_event, poll_timeout_s=0.2)


def test_fresh_trainer_warm_starts_with_the_recipe_sft_then_a_restart_does_not(test_cluster):
    """`astraflow run RECIPE` alone: a fresh trainer runs the policy's `sft` before publishing v0 (in
    the publish dtype); a trainer that finds a stored version (the demo's v0) does not warm-start."""
    import torch
    from raas_support import TINY_MODEL, make_recipe

    from astraflow.delta import WeightSubscriber
    from astraflow.delta.store import WeightStore
    from astraflow.log import Topics

    cfg = test_cluster
    recipe = make_recipe(cfg.run, policies=[{"name": "policy", "model": TINY_MODEL, "backend": {"lr": 1e-3},
                                             "sft": {"steps": 2, "batch_size": 8, "examples": 32}}])
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    try:
        first = _run_trainer_in_process(cfg, recipe, stop_first=True)
        assert (first["step"], first["version"]) == (0, 0)
        sub = WeightSubscriber(cfg, "policy", "test", register=False)
        v0 = {k: v.clone() for k, v in sub.pull(0)[0].items()}
        sub.close(unregister=False)
        init = load_tiny_model().state_dict()
        assert all(t.dtype == torch.bfloat16 for t in v0.values())  # trainer.publish_dtype default
        changed = [k for k in init if not torch.equal(v0[k], init[k].to(torch.bfloat16))]
        assert len(changed) > len(init) // 2, "v0 is the seeded init: the warm start did not run"
        second = _run_trainer_in_process(cfg, recipe, stop_first=True)
        assert WeightStore.from_config(cfg, "policy").versions() == [0]
        metrics.until(lambda items: len(_trainer_records(metrics)) >= 2, 30, "two start records")
    finally:
        metrics.close()
    starts = {r.life: r for r in _trainer_records(metrics) if isinstance(r, TrainerStart)}
    one, two = starts[first["life"]], starts[second["life"]]
    assert "SFT warm start (2 steps" in one.origin and one.warm_start["sft_steps"] == 2
    assert one.origin.endswith("published as v0")
    assert two.origin == "weight store version 0" and two.warm_start is None


def test_trainer_bootstrapped_from_the_store_publishes_v1_as_a_delta(test_cluster):
    """v0 published by someone else (the demo) in the publish dtype: the trainer's v1 is a sparse
    delta on it, not a fresh anchor, and a node at v0 applies it bit for bit."""
    import torch
    from raas_support import make_recipe

    from astraflow.delta import WeightSubscriber
    from astraflow.delta.publisher import WeightPublisher
    from astraflow.delta.store import WeightStore
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.log.range_reader import read_to_end
    from astraflow.records import batch
    from astraflow.trainer.service import publishable

    cfg = test_cluster
    with WeightPublisher(cfg, "policy", anchor_every=10) as pub:
        pub.publish(publishable(load_tiny_model().state_dict(), "bfloat16"), 0)
    node = WeightSubscriber(cfg, "policy", "test-node", register=False)
    node.pull(0)
    ensure_topics(cfg, {Topics(cfg.run).batches("policy"): 1})
    with LogProducer(cfg, "test-dataflow") as prod:  # a record the trainer cannot train: another policy's batch
        prod.send_table(Topics(cfg.run).batches("policy"), "other-1", batch.to_table(trainer_batch("other", "other-1")),
                        batch.SCHEMA_NAME, batch.SCHEMA_VERSION).result(10)
    send_batches(cfg, ["b0"])
    result = _run_trainer_in_process(cfg, make_recipe(cfg.run, trainer={"steps": 1}), stop_first=False)
    assert result["finished"] and result["version"] == 1 and result["skipped"]["invalid"] == 1
    # the dataflow hears that the record it served as a batch trains no step (its run is one batch longer)
    written = read_to_end(cfg, {(Topics(cfg.run).metrics, 0): 0}).messages
    events = [m.record for m in written if isinstance(m.record, TrainerSkipped)]
    assert [(e.reason, e.batch_id, e.policy) for e in events] == [("invalid", "other-1", "policy")]
    # each of the trainer's records went through its typed model, under its own schema name
    assert sorted(m.schema_name for m in written) == ["trainer-done", "trainer-skipped", "trainer-start",
                                                      "trainer-step"]
    store = WeightStore.from_config(cfg, "policy")
    m1 = store.manifest(1)
    assert (m1.kind, m1.base, m1.has_anchor) == ("delta", 0, False)
    state, version, _ = node.pull(1)
    node.close(unregister=False)
    assert version == 1 and all(t.dtype == torch.bfloat16 for t in state.values())
    assert m1.bytes < store.manifest(0).bytes


def test_a_checkpoint_is_saved_only_once_the_steps_it_covers_have_their_records_in_the_log(test_cluster,
                                                                                           monkeypatch):
    """A life resumed from a checkpoint never takes its steps again, so it cannot write their records
    again: by the time a checkpoint's save starts, the step record of every step it covers was sent (a
    compose run whose trainer was SIGKILLed after its step-10 checkpoint lacked step 10's record). Each
    record's log timestamp (the producer's send time) is compared with the moment the real save began."""
    import time

    from raas_support import make_recipe

    from astraflow.log import Topics
    from astraflow.log.range_reader import read_to_end
    from astraflow.trainer.checkpoint import CheckpointStore

    cfg = test_cluster
    save_began: dict[int, float] = {}
    save = CheckpointStore.save

    def timed_save(self, ckpt):
        save_began.setdefault(ckpt.step, time.time() * 1000)
        return save(self, ckpt)

    monkeypatch.setattr(CheckpointStore, "save", timed_save)
    send_batches(cfg, [f"b{i}" for i in range(4)])
    recipe = make_recipe(cfg.run, trainer={"steps": 4, "checkpoint_every": 2, "max_publish_lag": 2})
    result = _run_trainer_in_process(cfg, recipe, stop_first=False)
    assert result["finished"] and sorted(save_began) == [2, 4]
    written = read_to_end(cfg, {(Topics(cfg.run).metrics, 0): 0}).messages
    sent_at = {m.obj["step"]: m.timestamp_ms for m in written if m.schema_name == "trainer-step"}
    assert sorted(sent_at) == [1, 2, 3, 4]
    late = {(step, ckpt): sent_at[step] - began for ckpt, began in save_began.items()
            for step in range(1, ckpt + 1) if sent_at[step] > began}
    assert not late, f"step records sent after the save of a checkpoint covering them began (ms late): {late}"


def _trainer_rank(cfg, recipe) -> dict:
    """One rank of a trainer group (started by torch's elastic agent): the component itself."""
    import threading

    from astraflow.trainer.service import run_trainer

    return run_trainer(cfg, recipe, "policy", threading.Event(), poll_timeout_s=0.2)


@pytest.mark.slow
def test_a_two_rank_trainer_reads_each_batch_once_and_resumes_on_one_rank(test_cluster):
    """Rank 0 alone is the batch topic's consumer: each batch (a re-sent copy skipped) is trained once
    by the group, the group's offsets are committed through its last record, one record stream comes
    out, and its sharded checkpoint resumes on a single-rank trainer, which trains only what follows."""
    from process_helpers import launch_ranks
    from raas_support import make_recipe

    from astraflow.log import ConsumerGroups, Topics
    from astraflow.log.lag import committed_offsets
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore

    cfg = test_cluster
    topic = Topics(cfg.run).batches("policy")
    send_batches(cfg, ["b0", "b1", "b1", "b2", "b3"])  # b1 twice: a restarted dataflow re-sent it
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    try:
        group = launch_ranks(_trainer_rank, 2, cfg, make_recipe(cfg.run, trainer={"steps": 4, "checkpoint_every": 2}))
        assert [(r["rank"], r["ranks"], r["step"], r["finished"]) for _, r in sorted(group.items())] == [
            (0, 2, 4, True), (1, 2, 4, True)]
        assert group[0]["life"] == group[1]["life"] and group[0]["skipped"]["duplicate"] == 1
        assert committed_offsets(cfg, ConsumerGroups(cfg.run).trainer("policy")) == {(topic, 0): 5}
        checkpoints = CheckpointStore(ObjectStore.from_config(cfg), cfg.run, "policy")
        pointer = checkpoints.store.get_json(checkpoints._key("latest.json"))
        assert (pointer["format"], pointer["world_size"], pointer["step"]) == (3, 2, 4)
        send_batches(cfg, ["b4", "b5"])
        one = _run_trainer_in_process(cfg, make_recipe(cfg.run, trainer={"steps": 6, "checkpoint_every": 2}),
                                      stop_first=False)
        assert (one["step"], one["ranks"]) == (6, 1)
        metrics.until(lambda items: sum(isinstance(r, TrainerDone) for r in _trainer_records(metrics)) == 2, 60,
                      "both lives done")
    finally:
        metrics.close()
    records = _trainer_records(metrics)
    starts = [r for r in records if isinstance(r, TrainerStart)]
    assert [s.life for s in starts] == [group[0]["life"], one["life"]]  # one start record per life
    assert starts[1].origin == "checkpoint step 4 (version 4)"
    steps = [(r.life, r.step, r.batch_id) for r in records if isinstance(r, TrainerStep)]
    assert steps == [(group[0]["life"], i + 1, f"b{i}") for i in range(4)] + [(one["life"], 5, "b4"), (one["life"], 6, "b5")]
    assert [r.batch_id for r in records if isinstance(r, TrainerSkipped)] == ["b1"]
    # the group published each version in two parts (each rank its rows), the one-rank life whole; a node
    # that held the group's last version reaches the one-rank life's, and the chain verifies
    from astraflow.delta import WeightStore, WeightSubscriber
    from astraflow.delta.verify import verify_chain

    store = WeightStore.from_config(cfg, "policy")
    assert [len(store.manifest(v).parts) for v in range(7)] == [2] * 5 + [1] * 2
    node = WeightSubscriber(cfg, "policy", "node", register=False)
    assert node.pull(4)[1] == 4 and node.pull(6)[1] == 6
    assert all(c.ok for c in verify_chain(store))


def test_a_kl_objective_takes_version_0_from_the_store_as_its_reference(test_cluster):
    """The reference is v0 as published: the first step's policy is exactly v0, so its KL is 0, and the
    second's is not; the in-run GC keeps v0; a run whose v0 is gone is refused, naming the setting that
    keeps it."""
    import time

    import torch
    from raas_support import TINY_MODEL, make_recipe

    from astraflow.delta.publisher import WeightPublisher
    from astraflow.delta.store import WeightStore
    from astraflow.log import Topics
    from astraflow.log.range_reader import read_to_end
    from astraflow.trainer.service import publishable

    cfg = test_cluster
    v0 = publishable(load_tiny_model().state_dict(), "bfloat16")
    with WeightPublisher(cfg, "policy", anchor_every=10) as pub:
        pub.publish(v0, 0)
    send_batches(cfg, ["b0", "b1", "b2"])
    kl = {"lr": 1e-2, "objective": {"kl": {"coef": 0.5, "estimator": "k3"}}}
    # an anchor per version and GC after each: v1 goes, v0 (the reference) is pinned
    recipe = make_recipe(cfg.run, trainer={"steps": 3, "anchor_every": 1, "weights_gc_every": 1},
                         policies=[{"name": "policy", "model": TINY_MODEL, "backend": kl}])
    result = _run_trainer_in_process(cfg, recipe, stop_first=False)
    assert result["finished"] and result["version"] == 3
    steps = sorted((m.record for m in read_to_end(cfg, {(Topics(cfg.run).metrics, 0): 0}).messages
                    if isinstance(m.record, TrainerStep)), key=lambda r: r.step)
    assert [s.step for s in steps] == [1, 2, 3]
    assert steps[0].kl_ref == 0.0 and steps[1].kl_ref > 0.0 and steps[1].entropy > 0.0
    store = WeightStore.from_config(cfg, "policy")
    deadline = time.monotonic() + 20
    while 1 in store.versions() and time.monotonic() < deadline:  # the GC runs on the publisher's thread
        time.sleep(0.2)
    assert store.versions() == [0, 2, 3]

    other = cfg.model_copy(update={"run": f"{cfg.run}-nov0"})
    with WeightPublisher(other, "policy", anchor_every=1) as pub:  # a store whose oldest version is 3
        pub.publish({k: v + torch.ones_like(v) for k, v in v0.items()}, 3)
    with pytest.raises(RuntimeError, match=r"version 0 .*trainer.weights_gc_every: 0"):
        _run_trainer_in_process(other, make_recipe(other.run, policies=[{"name": "policy", "model": TINY_MODEL,
                                                                         "backend": kl}]), stop_first=True)


def test_the_trained_batch_ids_in_memory_stay_within_the_checkpoints_window():
    """A long run's duplicate check keeps what a checkpoint keeps, not every id since the start."""
    from types import SimpleNamespace

    from astraflow.trainer.service import TrainerService

    svc = SimpleNamespace(checkpoints=SimpleNamespace(keep_batch_ids=3), batch_ids=[], _trained=set())
    for i in range(20):
        svc.batch_ids.append(f"b{i}")
        svc._trained.add(f"b{i}")
        TrainerService._forget_old_batch_ids(svc)
        assert len(svc.batch_ids) <= 6 and svc._trained == set(svc.batch_ids)
        assert svc.batch_ids[-3:] == [f"b{j}" for j in range(max(0, i - 2), i + 1)]
