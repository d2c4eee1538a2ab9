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
from sink_readers import read_mlflow_scalars, read_scalars, read_wandb_scalars
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


def _assert_step_figures(records: list[dict], max_new_tokens: int) -> None:
    """The figures peers log, in a real run's trainer step records, consistent with each other: a batch
    with any response cut at the cap has its longest response at the cap, one with every response cut has
    its mean there too; the torch backend's clip share and behaviour KL are there."""
    from astraflow.records.control import TrainerStep, parse_control

    steps = [parse_control(None, None, r) for r in records if r.get("component") == "trainer" and "batch_id" in r]
    assert steps and all(isinstance(s, TrainerStep) for s in steps)
    for s in steps:
        assert s.truncated_frac is not None and 0.0 <= s.truncated_frac <= 1.0, s
        assert s.response_len_max is not None and 1 <= s.response_len_max <= max_new_tokens, s
        assert s.response_len_mean is not None and 1.0 <= s.response_len_mean <= s.response_len_max, s
        if s.truncated_frac > 0:
            assert s.response_len_max == max_new_tokens, s
        if s.truncated_frac == 1.0:
            assert s.response_len_mean == max_new_tokens, s
        assert s.clip_frac is not None and 0.0 <= s.clip_frac <= 1.0 and s.behav_kl is not None, s
        assert 0.0 < s.busy_fraction <= 1.0, s


INTERRUPT_EXIT_S = 25.0
"""Ctrl+C to the prompt, components and the embedded stack stopped: at most this long. The stop waits
``interrupt_grace_s`` (3 s) for the components, not ``grace_s`` (15 s) plus a node's drain (30 s): a
launcher that waited those would take 45 s and fail here. The 10 s target of issue 39 is measured by
``benchmarks/ctrl_c_exit.py`` (6.0 s alone on this machine; this test took 6.0 s alone and 13.9 s once
beside the suite's other worker on two cores, so the bound leaves room for load, not for a regression)."""


PROMETHEUS_GAUGES = {
    "dataflow": 'astraflow_dataflow_counters_counters{component="dataflow",id="dataflow",name="tasks.emitted"}',
    "trainer-policy": 'astraflow_trainer_step_truncated_frac{component="trainer",id="trainer.policy",policy="policy"}',
    "raas-default-0": ('astraflow_node_status_tokens_per_s{component="raas",id="raas-default-0",'
                       'node_id="raas-default-0",pool="default"}'),
    "archive": 'astraflow_archiver_records{component="archive"}',
    "sinks": 'astraflow_sinks_records{component="sinks"}',
}
"""One gauge each component's ``/metrics`` must serve mid-run (``astraflow run --prometheus``)."""


def _scrape_every_component(run_dir: Path) -> None:
    import urllib.request

    targets = json.loads((run_dir / "prometheus.json").read_text())
    assert sorted(t["labels"]["component"] for t in targets) == sorted(PROMETHEUS_GAUGES), targets
    for t in targets:
        with urllib.request.urlopen(f"http://{t['targets'][0]}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert PROMETHEUS_GAUGES[t["labels"]["component"]] in text, (t, text[-3000:])


def test_ctrl_c_exits_within_10_s_and_the_run_resumes(tmp_path: Path) -> None:
    """SIGINT (what Ctrl+C sends) mid-run on an embedded stack the run started: exit status 130 within
    ``INTERRUPT_EXIT_S``, nothing left running; then ``--run-id`` of the same run resumes from its
    checkpoint and finishes. The first run also serves Prometheus from every component (scraped before
    the signal), its step records carry the figures peers log, and its TensorBoard, MLflow and W&B sinks
    have them."""
    state_dir = tmp_path / "state"
    env = _embedded_env(state_dir)
    sinks = {"tensorboard": {"dir": str(tmp_path / "tb")},
             "mlflow": {"tracking_uri": f"file:{tmp_path / 'mlruns'}", "experiment": "e2e"},
             "wandb": {"project": "e2e", "mode": "offline", "dir": str(tmp_path / "wb")}}
    first = LauncherProcess(tmp_path, "ctrl-c", env, 200, extra_args=("--prometheus",),
                            recipe_extra={"report": sinks})
    first.wait_for_step(2, timeout_s=90)
    _scrape_every_component(first.run_dir)
    pids = set(children(first.proc.pid))
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGINT)
    rc = first.wait(60)
    exit_s = time.monotonic() - t0
    out = first.output
    assert rc == 130 and "Traceback" not in out and "interrupted (SIGINT)" in out, out[-3000:]
    assert exit_s <= INTERRUPT_EXIT_S, f"exit took {exit_s:.1f} s:\n{out[-3000:]}"
    assert [p for p in pids if pid_alive(p)] == [] and _stack_pids(state_dir) == []
    png = first.run_dir / "report.png"  # drawn after the exit, by a process of its own
    wait_until(lambda: png.exists(), 60, "report.png of the interrupted run",
               on_timeout=lambda: png.with_suffix(".log").read_text() if png.with_suffix(".log").exists() else "")
    assert png.read_bytes()[:4] == b"\x89PNG"
    trained = max(r["step"] for r in first.records() if r.get("component") == "trainer" and "step" in r)
    _assert_step_figures(first.records(), max_new_tokens=3)  # the tiny math recipe's cap
    steps = {r["step"]: r for r in first.records() if r.get("component") == "trainer" and "batch_id" in r}
    tags = ("policy/reward_mean", "policy/truncated_frac", "pool/default/tokens_per_s")
    for sink, scalars in {"tensorboard": read_scalars(tmp_path / "tb" / "ctrl-c"),
                          "mlflow": read_mlflow_scalars(f"file:{tmp_path / 'mlruns'}", "e2e", "ctrl-c", tags),
                          "wandb": read_wandb_scalars(tmp_path / "wb" / "wandb", step_key="trainer/step")}.items():
        for figure in ("reward_mean", "truncated_frac"):
            assert dict(scalars[f"policy/{figure}"]) == pytest.approx({s: r[figure] for s, r in steps.items()}), sink
        assert scalars["pool/default/tokens_per_s"], (sink, sorted(scalars))
    first_lives = {r.get("life") for r in first.records()}

    second = LauncherProcess(tmp_path, "ctrl-c", env, trained + 2)
    assert second.wait(150) == 0, second.output[-3000:]
    # The durable log keeps the first life's metrics, which the second launcher reads again.
    after = [r for r in second.records() if r.get("life") not in first_lives]
    start = next(r for r in after if r.get("component") == "trainer" and r.get("event") == "start")
    assert start["origin"].startswith("checkpoint step "), start
    assert any(r.get("event") == "done" and r.get("life") == start["life"] for r in after)


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
