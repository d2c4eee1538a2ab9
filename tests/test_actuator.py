"""The local autoscaling actuator: its decision rules (pure), the recipe's ``autoscale`` section, and
the process side on real child processes (stand-ins for nodes; no broker)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from control_records_factory import actuator_event, node_status
from process_helpers import pid_alive
from waiting import wait_until

from astraflow.dataflow.autoscaler import AutoscaleConfig, autoscale_report
from astraflow.launcher.actuator import Actuator, PoolScaler
from astraflow.launcher.supervisor import ChildSpec, ProcessGroup
from astraflow.recipe import PoolAutoscale, PoolSpec, Recipe
from astraflow.records.control import (
    ActuatorEvent,
    AutoscaleReport,
    ControlRecordError,
    PoolReport,
    parse_control,
)


def report(nodes: int, target: int, reason: str = "trainer_starved") -> PoolReport:
    return PoolReport(nodes=nodes, target_nodes=target, reason=reason)


def scaler(**cfg) -> PoolScaler:
    cfg = {"max_nodes": 4, "cooldown_s": 10.0, "confirm_reports": 2, **cfg}
    return PoolScaler("p", PoolAutoscale(**cfg), started_at=0.0)


# -- decisions --------------------------------------------------------------------------------------
def test_confirmed_reports_scale_up_within_max() -> None:
    s = scaler()
    assert s.observe(report(1, 9), running=1, now=11) is None  # one report is not enough
    d = s.observe(report(1, 9), running=1, now=12)
    assert d is not None and (d.nodes, d.target, d.reason) == (1, 4, "trainer_starved")  # capped at max_nodes


def test_scale_down_within_min() -> None:
    s = scaler(min_nodes=2, confirm_reports=1)
    d = s.observe(report(4, 1, "rollout_surplus"), running=4, now=11)
    assert d is not None and d.target == 2


def test_cooldown_after_start_and_after_each_change() -> None:
    s = scaler(confirm_reports=1)
    assert s.observe(report(1, 2), running=1, now=9.9) is None  # the run's first nodes are still joining
    assert s.observe(report(1, 2), running=1, now=10).target == 2
    assert s.observe(report(2, 3), running=2, now=19.9) is None
    assert s.observe(report(2, 3), running=2, now=20).target == 3


def test_reports_inside_the_cooldown_do_not_count_towards_confirmation() -> None:
    s = scaler(confirm_reports=2)
    assert s.observe(report(1, 2), running=1, now=5) is None
    assert s.observe(report(1, 2), running=1, now=11) is None  # the first report that counts
    assert s.observe(report(1, 2), running=1, now=12).target == 2


def test_hysteresis_opposite_or_in_band_reports_reset_the_streak() -> None:
    s = scaler(confirm_reports=2)
    assert s.observe(report(2, 3), running=2, now=11) is None
    assert s.observe(report(2, 1, "rollout_surplus"), running=2, now=12) is None
    assert s.observe(report(2, 3), running=2, now=13) is None
    assert s.observe(report(2, 2, "in_band"), running=2, now=14) is None
    assert s.observe(report(2, 3), running=2, now=15) is None
    assert s.observe(report(2, 3), running=2, now=16).target == 3


def test_a_report_that_missed_a_running_node_is_no_evidence() -> None:
    """A node just started is not in the window yet: the report's target is relative to fewer nodes."""
    s = scaler(confirm_reports=1)
    assert s.observe(report(1, 2), running=2, now=50) is None
    assert s.observe(report(1, 1, "no_data"), running=1, now=50) is None


def test_nodes_joined_from_elsewhere_are_left_to_their_owners() -> None:
    """The dataflow saw 2 more nodes than the launcher runs (started by hand): its +1 is applied to
    the launcher's own count, and its -3 cannot take the launcher below min_nodes."""
    s = scaler(confirm_reports=1, cooldown_s=0)
    assert s.observe(report(3, 4), running=1, now=1).target == 2
    assert s.observe(report(4, 1, "rollout_surplus"), running=2, now=2).target == 1


def test_the_dataflow_report_drives_the_scaler() -> None:
    """What the dataflow publishes (autoscale_report) is what the actuator reads: a starved trainer
    (w = 0.5) asks for twice the nodes, a surplus (w = 0, a quarter of the trajectories batched)
    for fewer."""
    cfg = AutoscaleConfig()
    up = autoscale_report(cfg, {"p": {"nodes": 1, "wait_s": 5, "step_s": 10, "consumed": 8, "entered": 8}}, 1.0)
    down = autoscale_report(cfg, {"p": {"nodes": 2, "wait_s": 0, "step_s": 10, "consumed": 2, "entered": 8}}, 2.0)
    s = scaler(confirm_reports=1, cooldown_s=0)
    # What a reader of the metrics topic gets: the record's JSON parsed by its headers' schema.
    up, down = (parse_control(r.SCHEMA_NAME, r.SCHEMA_VERSION, r.to_json()) for r in (up, down))
    assert s.observe(up.pools["p"], running=1, now=1).target == 2
    assert s.observe(down.pools["p"], running=2, now=2).target == 1
    assert up.pools["p"] == PoolReport(nodes=1, target_nodes=2, w=0.5, reason="trainer_starved")
    # A malformed report is refused whole (the consumer dead-letters it), not read in part.
    with pytest.raises(ControlRecordError, match="pools.p.nodes"):
        parse_control(up.SCHEMA_NAME, up.SCHEMA_VERSION, {**up.to_json(), "pools": {"p": {"nodes": "x"}}})


# -- recipe --------------------------------------------------------------------------------------------
def test_recipe_autoscale_section_is_checked() -> None:
    from pydantic import ValidationError

    pool = PoolSpec(nodes=2, autoscale={"min_nodes": 1, "max_nodes": 6})
    assert pool.autoscale.max_nodes == 6 and pool.autoscale.confirm_reports == 2
    with pytest.raises(ValidationError, match=r"nodes 7 is outside autoscale \[min_nodes 1, max_nodes 6\]"):
        PoolSpec(nodes=7, autoscale={"max_nodes": 6})
    with pytest.raises(ValidationError, match="min_nodes 3 > max_nodes 2"):
        PoolAutoscale(min_nodes=3, max_nodes=2)
    with pytest.raises(ValidationError, match="min_nodes"):
        PoolAutoscale(min_nodes=0, max_nodes=2)  # a pool without nodes would never be reported again


def test_task_topic_has_a_partition_per_node_up_to_max_nodes() -> None:
    from astraflow.launcher.plan import run_topics

    recipe = Recipe.model_validate({"policies": [{"name": "policy"}],
                                    "pools": [{"name": "default", "autoscale": {"max_nodes": 6}}]})
    assert run_topics(recipe, "r")["r.tasks.default"] == 6


# -- the process side, on stand-in processes -----------------------------------------------------------
# A node stand-in: on SIGTERM it "drains" for a moment and exits 0, like a RaaS node's clean stop.
DRAINER = textwrap.dedent("""
    import signal, sys, time
    def stop(*_):
        time.sleep(0.3)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("ready".upper(), flush=True)
    time.sleep(600)
""")


def _drainer(tmp_path: Path, ignore_term: bool = False):
    code = DRAINER.replace("signal.signal(signal.SIGTERM, stop)", "signal.signal(signal.SIGTERM, signal.SIG_IGN)") \
        if ignore_term else DRAINER

    def spec(pool: str, index: int) -> ChildSpec:
        name = f"raas-{pool}-{index}"
        return ChildSpec(name, [sys.executable, "-c", code], dict(os.environ), tmp_path / "logs" / f"{name}.log")
    return spec


def _wait_ready(path: Path, timeout_s: float = 20.0) -> None:
    wait_until(lambda: "READY" in (path.read_text() if path.exists() else ""), timeout_s, f"{path} to get ready")


def _wait_retired(group: ProcessGroup, actuator: Actuator, timeout_s: float = 20.0) -> None:
    def retired() -> bool:
        if not group.retiring:
            return True
        actuator.check()
        return False

    wait_until(retired, timeout_s, "the retiring nodes to stop",
               on_timeout=lambda: f"still retiring: {list(group.retiring)}")


def _autoscale(pool: str, nodes: int, target: int, reason: str, age_s: float = 0.0) -> AutoscaleReport:
    return AutoscaleReport(time=time.time() - age_s, pools={pool: PoolReport(nodes=nodes, target_nodes=target, w=0.5,
                                                                             reason=reason)})


def test_actuator_starts_and_drains_nodes(tmp_path: Path) -> None:
    spec = _drainer(tmp_path)
    pool = PoolSpec(name="p", nodes=1, drain_timeout_s=5,
                    autoscale={"max_nodes": 3, "cooldown_s": 0, "confirm_reports": 1})
    group = ProcessGroup(grace_s=2)
    records: list[ActuatorEvent] = []
    actuator = Actuator([pool], group, spec, grace_s=2, note=records.append)
    try:
        first = group.start(spec("p", 0))
        actuator.observe(_autoscale("p", 1, 3, "trainer_starved", age_s=60))
        assert list(group.children) == ["raas-p-0"], "a report older than the actuator is history"
        actuator.observe(_autoscale("p", 1, 3, "trainer_starved"))
        assert list(group.children) == ["raas-p-0", "raas-p-1", "raas-p-2"]
        for name in ("raas-p-1", "raas-p-2"):
            _wait_ready(tmp_path / "logs" / f"{name}.log")
        newest = group.children["raas-p-2"].proc.pid
        actuator.observe(_autoscale("p", 3, 2, "rollout_surplus"))
        assert list(group.children) == ["raas-p-0", "raas-p-1"] and list(group.retiring) == ["raas-p-2"]
        _wait_retired(group, actuator)
        assert not pid_alive(newest) and group.check() == []  # retired: not restarted
        actuator.observe(_autoscale("p", 2, 9, "trainer_starved"))  # the free index is taken again
        assert list(group.children) == ["raas-p-0", "raas-p-1", "raas-p-2"]
    finally:
        group.stop()
    events = [(r.event, r.node, r.returncode) for r in records]
    assert events == [("scale", None, None), ("start", "raas-p-1", None), ("start", "raas-p-2", None),
                      ("scale", None, None), ("stop", "raas-p-2", None), ("stopped", "raas-p-2", 0),
                      ("scale", None, None), ("start", "raas-p-2", None)]
    assert [(r.nodes, r.target) for r in records if r.event == "scale"] == [(1, 3), (3, 2), (2, 3)]
    assert not pid_alive(first.proc.pid)
    actuator.observe(_autoscale("p", 1, 3, "trainer_starved"))  # after the stop: nothing starts
    assert len(records) == 8


def test_a_node_that_does_not_drain_is_killed_after_its_drain_time(tmp_path: Path) -> None:
    spec = _drainer(tmp_path, ignore_term=True)
    pool = PoolSpec(name="p", nodes=2, drain_timeout_s=0.5,
                    autoscale={"max_nodes": 2, "cooldown_s": 0, "confirm_reports": 1})
    group = ProcessGroup(grace_s=2)
    records: list[ActuatorEvent] = []
    actuator = Actuator([pool], group, spec, grace_s=0.5, note=records.append)
    try:
        for i in range(2):
            group.start(spec("p", i))
        _wait_ready(tmp_path / "logs" / "raas-p-1.log")
        actuator.observe(_autoscale("p", 2, 1, "rollout_surplus"))
        _wait_retired(group, actuator)
    finally:
        group.stop(grace_s=0.2)
    stopped = [r for r in records if r.event == "stopped"]
    assert [(r.node, r.returncode) for r in stopped] == [("raas-p-1", -9)] and stopped[0].drain_s >= 1.0


def test_the_live_view_drops_a_retired_node() -> None:
    """A stopped node leaves the node table and the token rate, also when its last metrics record is
    read after the actuator saw it exit; a node started later under its name is shown again."""
    from astraflow.launcher.progress import RunProgress

    p = RunProgress(run="r", steps=3, policies=["policy"])
    for node in ("raas-p-0", "raas-p-1"):
        p.update(node_status(node, "p", tokens_per_s=100.0))
    p.update(actuator_event("stopped", "p", node="raas-p-1", returncode=0, drain_s=1.0))
    p.update(node_status("raas-p-1", "p", tokens_per_s=50.0))  # its last record, read late
    assert list(p.nodes) == ["raas-p-0"] and "nodes 1 100 tok/s" in p.summary_line()
    p.update(actuator_event("start", "p", node="raas-p-1", pid=1))
    p.update(node_status("raas-p-1", "p", tokens_per_s=10.0))
    assert sorted(p.nodes) == ["raas-p-0", "raas-p-1"]
