"""End to end: ``astraflow run`` scales an autoscaled pool up and then down during a run, on the real
broker and bucket, and no task is lost.

The reports are driven by the test: it publishes them on the run's metrics topic as the dataflow
would (same record, built by :func:`autoscale_report` from a starved and then an over-provisioned
window), with the dataflow's own report interval set beyond the run, so that the two phases happen
when the test wants them and not when the machine's load makes the trainer wait. Everything after
the report is the real path: the launcher's monitor reads it, the actuator starts ``raas-default-1``
as a separate process, the node joins the pool's consumer group and works, then is SIGTERMed, drains
and exits; the dataflow, the trainer and the other node carry the run to its last step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from process_helpers import children, pid_alive

from astraflow.dataflow.autoscaler import AutoscaleConfig, autoscale_report
from astraflow.launcher.cluster import write_cluster_file
from astraflow.records.control import AutoscaleReport, send_control

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 40
"""The trainer's pace (``step_base_s``) makes the run last ~50 s after its first batch, whatever the
nodes do: long enough for a node started mid-run to join, work, drain and exit (with 24 steps, ~30 s, a
loaded CI run finished training between the node's stop and its exit)."""
POOL = {"name": "default", "nodes": 1, "concurrency": 4, "drain_timeout_s": 10,
        "autoscale": {"min_nodes": 1, "max_nodes": 2, "cooldown_s": 2, "confirm_reports": 2},
        "engine": {"type": "simulated", "tokens_per_s": 40, "median_tokens": 24, "sigma": 0.5, "max_tokens": 96}}


def _recipe(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "recipes" / "sim_single.yaml").read_text())
    data["dataset"]["samples"] = 2
    data["policies"][0]["model"] = str(ROOT / "examples" / "models" / "tiny.yaml")
    data["policies"][0]["backend"] = {"type": "simulated", "step_base_s": 0.5, "step_s_per_token": 1e-4,
                                      "params": 4096}
    data["pools"] = [POOL]
    data["sampling"] = {"policy": {"max_new_tokens": 96}}
    # The test publishes the reports; the dataflow's own would come after the run.
    data["dataflow"] = {"mode": "async", "groups_per_batch": 4, "max_staleness": 2,
                        "autoscale": {"interval_s": 3600}}
    data["trainer"] = {"steps": STEPS, "checkpoint_every": 100}
    path = tmp_path / "autoscaled.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Run:
    """``astraflow run`` as a subprocess, its metrics.jsonl, and the test's report publisher."""

    def __init__(self, tmp_path: Path, cfg) -> None:
        from astraflow.log import LogProducer, Topics

        self.cfg = cfg
        self.run_dir = tmp_path / "runs" / cfg.run
        self.out_path = tmp_path / "launcher.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
        env["ASTRAFLOW_CONFIG"] = str(write_cluster_file(cfg, tmp_path / "cluster.yaml"))
        cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(_recipe(tmp_path)), "--run-id", cfg.run,
               "--runs-dir", str(tmp_path / "runs"), "--no-live", "--no-archive", "--timeout", "150", "--grace", "5"]
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        self.topic = Topics(cfg.run).metrics
        self.producer = LogProducer(cfg, f"{cfg.run}.test-autoscaler")
        self.trajectories = None
        """The test's reader of the trajectories topic, opened by :meth:`watch_trajectories`."""
        self.by_node: Counter[str] = Counter()
        """Trajectories seen on the log per node id."""

    def watch_trajectories(self) -> None:
        """Read the trajectories topic from its start. Opened only once the launcher created the run's
        topics: a consumer subscribing to a topic that does not exist yet has the broker auto-create it
        with its default partitions, and the launcher then finds it existing.

        The group join is awaited in a tight poll loop: kafka-python 3.0.12 drops a JoinGroup/SyncGroup
        that completes while no poll() is waiting for it and starts a new one (``join_group_async``
        reschedules a finished ``_join_task``), and Tansu answers each join after ~3 s; polling 0.1 s
        out of every ~0.3 s, as :meth:`wait_for` does, never joined on a loaded machine."""
        from astraflow.log import LogConsumer, Topics

        self.trajectories = LogConsumer(self.cfg, Topics(self.cfg.run).trajectories,
                                        group_id=f"{self.cfg.run}.test-watch", auto_offset_reset="earliest")
        self.trajectories.wait_for_assignment(60)

    @property
    def output(self) -> str:
        return self.out_path.read_text()

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def actuations(self, event: str) -> list[dict]:
        return [r for r in self.records() if r.get("kind") == "actuator" and r.get("event") == event]

    def wait_for(self, what: str, found, timeout_s: float = 40.0, report: AutoscaleReport | None = None):
        """Until ``found(records)`` is truthy; meanwhile publish ``report`` every second, as the
        dataflow publishes one every ``interval_s``."""
        from astraflow.records import trajectory as traj_rec

        deadline, last_sent = time.monotonic() + timeout_s, 0.0
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launcher ended before {what} ({self.by_node}):\n{self.output[-3000:]}"
            for m in self.trajectories.poll(timeout_s=0.1, max_records=500) if self.trajectories else []:
                self.by_node.update(t.node_id for t in traj_rec.from_table(m.table))
            result = found(self.records())
            if result:
                return result
            if report is not None and time.monotonic() - last_sent >= 1.0:
                send_control(self.producer, self.topic, "dataflow", report.model_copy(update={"time": time.time()}))
                self.producer.flush(5)
                last_sent = time.monotonic()
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout_s} s ({self.by_node}):\n{self.output[-3000:]}")

    def close(self) -> None:
        self.producer.close()
        if self.trajectories is not None:
            self.trajectories.close()
        if self.proc.poll() is None:
            self.proc.kill()


def _tasks_emitted(recs: list[dict]) -> bool:
    """The dataflow has put tasks on the pool's topic: the run is under way."""
    return any(r.get("component") == "dataflow" and (r.get("counters") or {}).get("tasks.emitted", 0) > 0
               for r in recs)


def _node_processes(launcher: int) -> list[str]:
    """The node ids of the launcher's live RaaS node processes."""
    return sorted(a[a.index("--node-id") + 1] for a in children(launcher).values() if "--node-id" in a)


def _window(nodes: int, wait_s: float, consumed: int) -> dict:
    return {"nodes": nodes, "wait_s": wait_s, "step_s": 10.0, "consumed": consumed, "entered": 8}


def _read_back(cfg) -> tuple[list[tuple[int, int, str]], set[str], dict]:
    """(partition, offset, prompt id) of every task record, the task ids that have trajectories, and
    the pool group's committed offsets, read from the log after the run."""
    from astraflow.log import ConsumerGroups, LogConsumer, Topics
    from astraflow.log.lag import committed_offsets
    from astraflow.records import task as task_rec
    from astraflow.records import trajectory as traj_rec

    topics = Topics(cfg.run)
    consumer = LogConsumer(cfg, [topics.tasks("default"), topics.trajectories], group_id=f"{cfg.run}.check")
    tasks, returned, idle = [], set(), 0
    try:
        consumer.wait_for_assignment(30)
        while idle < 2:
            msgs = consumer.poll(timeout_s=1.0, max_records=1000)
            idle = 0 if msgs else idle + 1
            for m in msgs:
                if m.topic == topics.trajectories:
                    returned |= {t.task_id for t in traj_rec.from_table(m.table)}
                else:
                    tasks += [(m.partition, m.offset, t.prompt_id) for t in task_rec.from_table(m.table)]
    finally:
        consumer.close()
    return tasks, returned, committed_offsets(cfg, ConsumerGroups(cfg.run).raas("default"))


@pytest.mark.timeout(300)
def test_the_actuator_scales_a_pool_up_and_down_and_loses_no_task(tmp_path: Path, test_cluster) -> None:
    cfg = AutoscaleConfig()
    starved = autoscale_report(cfg, {"default": _window(1, wait_s=5.0, consumed=8)}, 0.0)  # w = 0.5
    surplus = autoscale_report(cfg, {"default": _window(2, wait_s=0.0, consumed=2)}, 0.0)  # a quarter batched
    assert (starved.pools["default"].target_nodes, surplus.pools["default"].target_nodes) == (2, 1)

    run = Run(tmp_path, test_cluster)
    try:
        # Scale up as soon as the run has work out: the new node's start-up (imports, weight catch-up)
        # then overlaps the first node's, which keeps the test short and independent of the machine's load.
        run.wait_for("tasks emitted", _tasks_emitted, timeout_s=60)
        run.watch_trajectories()
        (start,) = run.wait_for("a node started", lambda _: run.actuations("start"), report=starved)
        assert start["node"] == "raas-default-1"
        argv = children(run.proc.pid).get(start["pid"], [])
        assert "--node-id" in argv and argv[argv.index("--node-id") + 1] == "raas-default-1", children(run.proc.pid)
        run.wait_for("trajectories of raas-default-1", lambda _: run.by_node["raas-default-1"], timeout_s=90)
        assert _node_processes(run.proc.pid) == ["raas-default-0", "raas-default-1"]
        assert run.by_node["raas-default-0"] > 0, run.by_node
        (stop,) = run.wait_for("a node stopped", lambda _: run.actuations("stop"), report=surplus)
        (stopped,) = run.wait_for("the node's exit", lambda _: run.actuations("stopped"))
        assert _node_processes(run.proc.pid) == ["raas-default-0"]
        rc = run.proc.wait(timeout=90)
    finally:
        run.close()
    out = run.output
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out and "autoscale pool default: 1 -> 2 nodes (trainer_starved" in out

    # The newest node drained: SIGTERM, then a clean exit (status 0), not the SIGKILL past its drain time.
    assert stop["node"] == stopped["node"] == "raas-default-1" and stopped["returncode"] == 0, stopped
    assert not pid_alive(start["pid"])
    log = (run.run_dir / "logs" / "raas-default-1.log").read_text()
    last = json.loads(log.strip().splitlines()[-1])  # `astraflow raas` prints its counters after a clean stop
    assert last["node_id"] == "raas-default-1" and last["episodes"] > 0 and last["rejected"] == 0

    records = run.records()
    scales = [(r["nodes"], r["target"], r["reason"]) for r in records if r.get("event") == "scale"]
    assert scales == [(1, 2, "trainer_starved"), (2, 1, "rollout_surplus")]
    steps = [r["step"] for r in records if r.get("component") == "trainer" and "step_s" in r]
    assert max(steps) == STEPS and any(r.get("event") == "done" for r in records)
    counters = [r["counters"] for r in records if r.get("component") == "dataflow" and r.get("kind") == "dataflow"][-1]
    assert counters.get("tasks.expired", 0) == 0 and counters.get("trajectories.invalid_records", 0) == 0, counters
    nodes = {r["node_id"]: r for r in records if r.get("component") == "raas"}  # each node's last record
    assert set(nodes) == {"raas-default-0", "raas-default-1"} and all(n["rejected"] == 0 for n in nodes.values())

    # No task lost: every task record the pool's consumer group committed (its offset below the
    # group's committed offset) came back as trajectories, whichever node ran it; tasks past the
    # committed offsets were still in flight when the run ended.
    tasks, returned, committed = _read_back(test_cluster)
    done = [t for t in tasks if t[1] < committed.get((f"{test_cluster.run}.tasks.default", t[0]), 0)]
    assert len(done) >= STEPS * 4, (len(done), len(tasks), committed)  # at least the trained groups
    lost = [t for t in done if t[2] not in returned]
    assert lost == [], f"{len(lost)} committed tasks never came back: {lost[:5]}"
    assert counters["tasks.emitted"] == len({t[2] for t in tasks})
