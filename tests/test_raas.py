"""RaaS node: offset bookkeeping (unit) and the node on the real embedded stack (integration)."""

from __future__ import annotations

import signal
import threading

import pytest
from raas_support import (
    TopicReader,
    make_recipe,
    publish_v0,
    recipe_dict,
    send_tasks,
    start_component,
    stop,
    write_files,
)
from waiting import wait_until

from astraflow.raas.inflight import InFlightTasks


# -- unit: what may be committed ----------------------------------------------------------------
class _Msg:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset


def test_record_is_ready_only_when_all_its_tasks_finished():
    inflight: InFlightTasks = InFlightTasks()
    a, b = _Msg("t", 0, 0), _Msg("t", 0, 1)
    inflight.add(a, 3)
    inflight.add(b, 1)
    assert inflight.tasks == 4
    assert inflight.task_done(a) is None
    assert inflight.task_done(b) is b
    assert inflight.task_done(a) is None
    assert inflight.task_done(a) is a
    assert len(inflight) == 0 and inflight.tasks == 0
    with pytest.raises(KeyError):
        inflight.task_done(a)


def test_out_of_order_completion_commits_only_the_contiguous_prefix():
    """The node hands finished records to LogConsumer.commit; its ProcessedOffsets must never move
    the commit point past a record still running (that record would be lost on SIGKILL)."""
    from astraflow.log.offsets import ProcessedOffsets

    tp = ("run.tasks.default", 0)
    offsets = ProcessedOffsets()
    inflight: InFlightTasks = InFlightTasks()
    msgs = [_Msg(*tp, o) for o in range(5)]
    for m in msgs:
        offsets.delivered(tp, m.offset)
        inflight.add(m, 2)
    # records 1, 2 and 4 finish first (both tasks each); 0 and 3 are still running
    for m in (msgs[4], msgs[2], msgs[1]):
        for _ in range(2):
            done = inflight.task_done(m)
        offsets.processed(tp, done.offset)
    assert offsets.to_commit() == {}
    inflight.task_done(msgs[0])
    assert offsets.to_commit() == {}  # half of record 0 still runs
    offsets.processed(tp, inflight.task_done(msgs[0]).offset)
    assert offsets.to_commit() == {tp: 3}  # 0, 1, 2 done; 3 still runs
    offsets.committed({tp: 3})
    for _ in range(2):
        done = inflight.task_done(msgs[3])
    offsets.processed(tp, done.offset)
    assert offsets.to_commit() == {tp: 5}


# -- integration ------------------------------------------------------------------------------
def test_trajectories_carry_per_token_versions_and_follow_a_new_version(test_cluster):
    import torch

    from astraflow.delta.publisher import WeightPublisher  # noqa: F401
    from astraflow.log import Topics, committed_offsets
    from astraflow.raas import RaasNode

    torch.set_num_threads(1)
    cfg = test_cluster
    pub, model = publish_v0(cfg)
    recipe = make_recipe(cfg.run)
    stop_event = threading.Event()
    node = RaasNode.from_config(cfg, recipe, "default", "node-a", stop_event, metrics_every_s=1.0)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    reader = TopicReader(cfg, Topics(cfg.run).trajectories)
    try:
        first = send_tasks(cfg, 3, "first")
        reader.until(lambda items: {t.task_id for t in items} >= set(first), 90, "first tasks",
                     alive=lambda: thread.is_alive() or pytest.fail("node died"))
        for t in reader.items:
            assert len(t.versions) == len(t.response_ids) == len(t.logprobs) > 0
            assert set(t.versions) == {0}
            assert t.node_id == "node-a"
        # A new version mid-run: the node refreshes without stopping.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        pub.publish(model.state_dict(), 1)
        pub.flush()
        wait_until(lambda: node.follower.versions.get("policy") == 1, 30, "the node to pick up v1", interval_s=0.2,
                   on_timeout=lambda: f"follower versions: {node.follower.versions}")
        second = send_tasks(cfg, 3, "second")
        reader.until(lambda items: {t.task_id for t in items} >= set(second), 90, "second tasks")
        later = [t for t in reader.items if t.task_id in set(second)]
        assert all(set(t.versions) == {1} for t in later), [t.versions for t in later]
        assert node.follower.refreshes >= 2
        # every task record was committed after its trajectories were acknowledged, in the group and on
        # the topic that a Kubernetes deployment's KEDA trigger watches (astraflow deploy k8s)
        from astraflow.deploy.k8s import kafka_trigger

        trigger = kafka_trigger(cfg, recipe.pool("default"))["metadata"]
        group = trigger["consumerGroup"]
        wait_until(lambda: sum(committed_offsets(cfg, group).values()) >= 6, 10,
                   f"6 task records committed by group {group}", interval_s=0.3,
                   on_timeout=lambda: committed_offsets(cfg, group))
        assert {topic for topic, _partition in committed_offsets(cfg, group)} == {trigger["topic"]}
    finally:
        stop_event.set()
        thread.join(60)
        reader.close()
        pub.close()
    assert not thread.is_alive()
    assert node.counters.episodes == 6 and node.counters.trajectories == 12


@pytest.mark.slow
def test_sigkill_of_a_node_mid_run_loses_no_task(test_cluster, tmp_path):
    from astraflow.log import Topics

    cfg = test_cluster
    pub, _ = publish_v0(cfg)
    pub.close()
    # a slower node (more samples, longer answers) so that the kill lands mid-run
    rd = recipe_dict(cfg.run, sampling={"policy": {"max_new_tokens": 8}})
    cfg_path, recipe_path = write_files(tmp_path, cfg, rd)
    ids = send_tasks(cfg, 16, "kill", samples=4)
    reader = TopicReader(cfg, Topics(cfg.run).trajectories)
    args = ["raas", "--recipe", str(recipe_path), "--pool", "default"]
    first = start_component(args + ["--node-id", "victim"], cfg_path, tmp_path / "victim.log")
    second = None
    try:
        reader.until(lambda items: len({t.task_id for t in items}) >= 3, 120, "the victim's first trajectories",
                     alive=lambda: first.poll() is None or pytest.fail((tmp_path / "victim.log").read_text()))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        before = {t.task_id for t in reader.items}
        assert before < set(ids), "the victim finished everything before the kill; the test proves nothing"
        second = start_component(args + ["--node-id", "survivor"], cfg_path, tmp_path / "survivor.log")
        reader.until(lambda items: {t.task_id for t in items} >= set(ids), 180, "every task",
                     alive=lambda: second.poll() is None or pytest.fail((tmp_path / "survivor.log").read_text()))
        got = {}
        for t in reader.items:
            got.setdefault(t.task_id, set()).add(t.sample_index)
        assert all(got[i] == {0, 1, 2, 3} for i in ids)  # whole groups for every task
        assert {t.node_id for t in reader.items} == {"victim", "survivor"}
    finally:
        if first.poll() is None:
            first.kill()
        if second is not None:
            assert stop(second) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
        reader.close()
