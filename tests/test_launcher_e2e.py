"""End to end: ``astraflow run`` and ``astraflow demo`` on the real broker and bucket, with the real
components as separate processes, on a tiny recipe for a few steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import LauncherProcess, launcher_env, leftover_processes, tiny_recipe
from process_helpers import children, pid_alive
from waiting import wait_until

from astraflow.launcher.cluster import write_cluster_file
from astraflow.records.control import SupervisorEvent, TrainerDone, TrainerStep
from astraflow.report.plot import typed_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_astraflow_demo_tiny(tmp_path: Path, test_cluster) -> None:
    """The demo's whole path (SFT, v0 publish, eval, launcher, pull, eval) on a tiny budget: it must
    run and report measured figures; learning itself is the demo's job, not this test's."""
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    recipe = tiny_recipe(tmp_path)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "demo", "--recipes", str(recipe), "--steps", "2",
           "--runs-dir", str(tmp_path / "runs"), "--no-live"]
    proc = subprocess.run(cmd, check=False, env=launcher_env(cluster_file), capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary_path,) = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    row = summary["policies"]["policy"]
    assert row["untrained"]["n"] == row["before"]["n"] == row["after"]["n"] == 20
    assert 0.0 <= row["before"]["accuracy"] <= 1.0 and row["final_version"] >= 2
    assert abs(row["delta"] - (row["after"]["accuracy"] - row["before"]["accuracy"])) < 1e-9
    assert "held-out accuracy" in proc.stdout and (summary_path.parent / "report.png").exists()


KILLS = ((2, "raas-default-0"), (4, "dataflow"), (6, "trainer-policy"))
KILL_RUN_STEPS = 24
"""Steps of the runs killed mid-way: a tiny step takes ~0.1 s on a quiet machine, and a run only a few
steps past its last kill point can end before the test sees that step (other tests of this kind failed
so: tests/test_bad_input.py, tests/test_archive_e2e.py)."""


def test_killed_components_are_restarted_and_the_run_finishes(tmp_path: Path, test_cluster) -> None:
    """One run, three SIGKILLs: the node at step 2, the dataflow at step 4, the trainer at step 6 of 24.
    With ``max_staleness: 1`` the dataflow cannot run more than a batch or two ahead, so the steps after
    each kill need the restarted component."""
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    launcher = LauncherProcess(tmp_path, test_cluster.run, launcher_env(cluster_file), KILL_RUN_STEPS, timeout_s=200)
    victims = []
    for step, component in KILLS:
        launcher.wait_for_step(step, timeout_s=90)
        victims.append(launcher.component_pid(component))
        os.kill(victims[-1], signal.SIGKILL)
    rc = launcher.wait(220)
    out = launcher.output
    assert rc == 0, out[-3000:]
    records = typed_records(launcher.records())
    restarts = [r for r in records if isinstance(r, SupervisorEvent)]
    # Each victim restarted once. Not in kill order: on a quiet machine the trainer can be past step 4
    # when the node dies, so two kills land within one backoff and restart in the supervisor's order.
    assert sorted((r.component, r.event, r.returncode, r.restarts) for r in restarts) == sorted(
        (component, "restart", -signal.SIGKILL, 1) for _, component in KILLS), restarts
    steps = [r.step for r in records if isinstance(r, TrainerStep)]
    assert max(steps) == KILL_RUN_STEPS and any(isinstance(r, TrainerDone) for r in records)
    assert "Traceback" not in out
    for _, component in KILLS:
        assert "restarts" in out and f"{component}=1" in out, out[-2000:]
        log = (launcher.run_dir / "logs" / f"{component}.log").read_text()
        assert f"supervisor: {component} was killed by signal 9 (SIGKILL); restart 1" in log
    assert not any(pid_alive(v) for v in victims) and leftover_processes(str(launcher.run_dir)) == []


def _embedded_env(state_dir: Path) -> dict[str, str]:
    """No cluster configured: ``astraflow run`` starts (and owns) an embedded stack in ``state_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_STATE_DIR"] = str(state_dir)
    return env


def _stack_pids(state_dir: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in state_dir.glob("*.pid")]


def test_sigterm_mid_run_stops_everything_with_130(tmp_path: Path) -> None:
    """SIGTERM to the launcher while it runs a recipe on an embedded stack it started, then another
    during the stop: exit status 130, no traceback, no component and no server left."""
    state_dir = tmp_path / "state"
    launcher = LauncherProcess(tmp_path, "sigterm", _embedded_env(state_dir), 20)
    launcher.wait_for_step(1, timeout_s=90)
    pids = set(children(launcher.proc.pid))  # dataflow, trainer, node, archiver, tansu, seaweedfs
    assert len(pids) == 6 and pids >= set(_stack_pids(state_dir)), pids
    launcher.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # deliberate: the second SIGTERM comes once the stop is under way, not with the first
    launcher.proc.send_signal(signal.SIGTERM)  # during the stop: ignored
    rc = launcher.wait(60)
    out = launcher.output
    assert rc == 130, out[-3000:]
    assert "Traceback" not in out and "interrupted (SIGTERM)" in out and "embedded stack stopped" in out
    assert [p for p in pids if pid_alive(p)] == []
    assert not (state_dir / "stack.json").exists() and _stack_pids(state_dir) == []


def test_sigterm_during_stack_start_up_leaves_nothing(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    launcher = LauncherProcess(tmp_path, "early", _embedded_env(state_dir), 2)

    def seaweedfs_started() -> bool:
        assert launcher.proc.poll() is None, launcher.output
        return (state_dir / "seaweedfs.pid").exists()

    wait_until(seaweedfs_started, 30, "the stack's seaweedfs.pid", interval_s=0.02, on_timeout=lambda: launcher.output)
    pids = _stack_pids(state_dir)
    launcher.proc.send_signal(signal.SIGTERM)
    rc = launcher.wait(30)
    out = launcher.output
    assert rc == 130 and "Traceback" not in out and "interrupted (SIGTERM)" in out, out
    assert [p for p in pids if pid_alive(p)] == [] and _stack_pids(state_dir) == []


def test_killed_embedded_servers_are_restarted(tmp_path: Path) -> None:
    """SIGKILL of the broker (step 2) and then of the S3 server (step 5) of the embedded stack the run
    started (durable log): each restarted on the same ports, and the run finishes."""
    state_dir = tmp_path / "state"
    launcher = LauncherProcess(tmp_path, "kill-servers", _embedded_env(state_dir), KILL_RUN_STEPS, timeout_s=200)
    victims = []
    for step, server in ((2, "tansu"), (5, "seaweedfs")):
        launcher.wait_for_step(step, timeout_s=90)
        victims.append(json.loads((state_dir / f"{server}.pid").read_text())["pid"])
        os.kill(victims[-1], signal.SIGKILL)
    rc = launcher.wait(220)
    out = launcher.output
    assert rc == 0, out[-3000:]
    records = typed_records(launcher.records())
    restarts = [(r.component, r.event, r.restarts) for r in records if isinstance(r, SupervisorEvent)]
    steps = [r.step for r in records if isinstance(r, TrainerStep)]
    assert max(steps) == KILL_RUN_STEPS and "Traceback" not in out
    for server in ("tansu", "seaweedfs"):
        assert (server, "restart", 1) in restarts, restarts
        assert f"supervisor: {server} died; restart 1" in (state_dir / "logs" / f"{server}.log").read_text()
    assert not any(pid_alive(v) for v in victims) and _stack_pids(state_dir) == []
