"""The launcher's process supervision, its stop semantics and the run report.

Process tests use real child processes (python sleepers that fork a helper, ignore SIGTERM, or die)
and check the kernel's process table afterwards: nothing may be left behind.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from control_records_factory import (
    autoscale_report,
    dataflow_counters,
    node_status,
    restart,
    trainer_done,
    trainer_step,
)
from process_helpers import pid_alive
from waiting import wait_until

from astraflow.launcher.restarts import NO_RESTART, RestartBook, RestartPolicy
from astraflow.launcher.supervisor import ChildExited, ChildSpec, ProcessGroup
from astraflow.records.control import SupervisorEvent
from astraflow.report.plot import typed_records

# A component stand-in: writes its pid and its helper's pid, then sleeps until signalled.
SLEEPER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:  # before the pids line: the test signals once it reads it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("pids", os.getpid(), helper.pid, flush=True)
    time.sleep(600)
""")


def _spec(tmp_path: Path, name: str, code: str, *args: str, may_exit: bool = False) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", code, *args], dict(os.environ), tmp_path / "logs" / f"{name}.log",
                     may_exit=may_exit)


def _pids_from_log(path: Path, timeout_s: float = 20.0) -> list[int]:
    def pids() -> list[int] | None:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("pids "):
                return [int(x) for x in line.split()[1:]]
        return None

    return wait_until(pids, timeout_s, f"the child to write its pids to {path}")


def _until_child_exited(group: ProcessGroup, timeout_s: float) -> ChildExited:
    """``group.check()`` each turn (restarts included) until it raises ChildExited."""
    with pytest.raises(ChildExited) as exc:
        wait_until(lambda: group.check() and False, timeout_s, "group.check() to raise ChildExited")
    return exc.value


def test_stop_terminates_children_and_their_helpers(tmp_path: Path) -> None:
    group = ProcessGroup(grace_s=5)
    group.start(_spec(tmp_path, "raas-a", SLEEPER))
    group.start(_spec(tmp_path, "raas-b", SLEEPER))
    pids = _pids_from_log(tmp_path / "logs/raas-a.log") + _pids_from_log(tmp_path / "logs/raas-b.log")
    assert all(pid_alive(p) for p in pids)
    assert group.check() == []
    t0 = time.monotonic()
    codes = group.stop()
    assert time.monotonic() - t0 < 5, "children that honour SIGTERM must not wait for the grace period"
    assert codes == {"raas-a": -signal.SIGTERM, "raas-b": -signal.SIGTERM}
    assert not any(pid_alive(p) for p in pids), "a child or its helper was left behind"


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    group = ProcessGroup(grace_s=1.0)
    group.start(_spec(tmp_path, "stubborn", SLEEPER, "--ignore-term"))
    pids = _pids_from_log(tmp_path / "logs/stubborn.log")  # printed after its handler is installed
    t0 = time.monotonic()
    codes = group.stop()
    assert 0.9 < time.monotonic() - t0 < 8
    assert codes["stubborn"] == -signal.SIGKILL
    assert not any(pid_alive(p) for p in pids)


def test_dead_child_is_named_with_its_log(tmp_path: Path) -> None:
    group = ProcessGroup(grace_s=2)
    group.start(_spec(tmp_path, "dataflow", SLEEPER))
    group.start(_spec(tmp_path, "raas-default-0", "import sys; print('cannot reach the broker'); sys.exit(3)"))
    err = _until_child_exited(group, 20)
    assert err.name == "raas-default-0" and err.returncode == 3
    assert err.log_path == tmp_path / "logs" / "raas-default-0.log"
    msg = str(err)
    assert "'raas-default-0' exited with status 3" in msg and str(err.log_path) in msg
    assert "cannot reach the broker" in msg  # the log tail is part of the error
    group.stop()
    assert group.alive() == []


def test_finished_trainer_is_not_a_failure(tmp_path: Path) -> None:
    """Status 0 of a component that may finish (a trainer after "done") is not restarted."""
    group = ProcessGroup(grace_s=2, restart=RestartPolicy(backoff_initial_s=0.0))
    group.start(_spec(tmp_path, "trainer-policy", "print('done')", may_exit=True))

    def finished() -> bool:
        if group.finished() == ["trainer-policy"]:
            return True
        assert group.check() == [], "a finished trainer was restarted"
        return False

    wait_until(finished, 20, "the trainer to be reported finished")
    assert group.check() == [] and group.restarts() == {}
    group.stop()


# -- restarts ---------------------------------------------------------------------------------
def test_restart_policy_backoff_and_budget() -> None:
    policy = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=5.0, max_restarts=4, window_s=100.0)
    book = RestartBook(policy)
    assert [book.on_exit(t) for t in (0.0, 1.0, 2.0, 3.0)] == [1.0, 2.0, 4.0, 5.0]  # doubling, capped
    assert book.on_exit(4.0) is None, "a fifth death within the window exhausts the budget"
    assert book.on_exit(99.0) is None and book.restarts == 4
    # The window slides: the restarts at 0 and 1 s are forgotten at 101 s, and so is their backoff.
    assert book.recent(101.0) == 2 and book.on_exit(101.0) == 4.0
    assert book.on_exit(500.0) == 1.0 and book.restarts == 6
    assert RestartBook(NO_RESTART).on_exit(0.0) is None
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(backoff_initial_s=10, backoff_max_s=1)


def _wait_restart(group: ProcessGroup, timeout_s: float = 20.0):
    return wait_until(group.check, timeout_s, "a restart (group.check() returned no event)")


def test_dead_child_is_restarted_until_its_budget_is_spent(tmp_path: Path) -> None:
    group = ProcessGroup(grace_s=2, restart=RestartPolicy(backoff_initial_s=0.2, max_restarts=2))
    group.start(_spec(tmp_path, "raas-a", SLEEPER))
    log = tmp_path / "logs/raas-a.log"
    first, helper = _pids_from_log(log)
    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    (event,) = _wait_restart(group)
    assert time.monotonic() - t0 >= 0.2, "restarted before its backoff"
    assert (event.name, event.returncode, event.restarts, event.backoff_s) == ("raas-a", -signal.SIGKILL, 1, 0.2)
    assert event.record().to_json()["kind"] == "supervisor" and event.record().event == "restart"
    wait_until(lambda: not pid_alive(helper), 10,
               "the dead child's helper to stop (it was left running beside its replacement)")
    text = log.read_text()
    assert "supervisor: raas-a was killed by signal 9 (SIGKILL); restart 1 in 0.2 s" in text
    assert text.count(" start: ") == 2  # same log file, a start line per run
    second = event.pid
    assert second != first and group.alive() == ["raas-a"]

    os.kill(second, signal.SIGKILL)
    (event,) = _wait_restart(group)
    assert event.restarts == 2 and event.backoff_s == 0.4 and group.restarts() == {"raas-a": 2}
    os.kill(event.pid, signal.SIGKILL)
    exited = _until_child_exited(group, 20)
    assert exited.name == "raas-a" and exited.restarts == 2
    msg = str(exited)
    assert "'raas-a' was killed by signal 9 (SIGKILL) unexpectedly after 2 restarts" in msg
    assert "restart budget exhausted (2 restarts within 600 s)" in msg and str(log) in msg
    group.stop()
    assert group.alive() == []


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL of the launcher itself (no chance to clean up): the kernel stops its children."""
    launcher = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from astraflow.launcher.supervisor import ChildSpec, ProcessGroup
        g = ProcessGroup()
        c = g.start(ChildSpec("raas", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                              Path({str(tmp_path)!r}) / "raas.log"))
        print(c.proc.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert pid_alive(child)
    proc.kill()
    proc.wait()
    wait_until(lambda: not pid_alive(child), 10, "the child to stop (it outlived its SIGKILLed launcher)")


# -- report ----------------------------------------------------------------------------------
def _metrics(path: Path) -> list[dict]:
    recs = []
    for step in range(1, 6):
        for policy in ("solver", "verifier"):
            recs.append(trainer_step(policy, step, reward_mean=0.2 + 0.1 * step, trajectories=128,
                                     publish_bytes=90000 if step % 5 == 0 else 3000,
                                     truncated_frac=0.6 - 0.1 * step, response_len_mean=40.0 - step,
                                     response_len_max=64, clip_frac=0.01, behav_kl=0.002).to_json())
        recs.append(node_status(time=100.0 + step, tokens_per_s=300 + step, versions={"solver": step}).to_json())
    recs.append(trainer_done("solver", 5, time=107.0).to_json())
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
        f.write('{"component": "trai')  # a torn last line (crash mid-write) is skipped
    return recs


def test_report_png_from_metrics_jsonl(tmp_path: Path) -> None:
    from astraflow.report import load_metrics, write_report
    from astraflow.report.plot import node_throughput, trainer_steps

    _metrics(tmp_path / "metrics.jsonl")
    records = load_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 16
    typed = typed_records([*records, {"component": "my-evaluator", "accuracy": 0.5}])  # a user's figures
    assert len(typed) == 16
    steps = trainer_steps(typed)
    assert sorted(steps) == ["solver", "verifier"] and [r.step for r in steps["solver"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in node_throughput(typed)["raas-default-0"]] == [301, 302, 303, 304, 305]
    png = write_report(records, tmp_path / "report.png", title="test")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_report_of_empty_run(tmp_path: Path) -> None:
    from astraflow.report import write_report

    png = write_report([], tmp_path / "report.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_progress_folds_the_metrics_contract(tmp_path: Path) -> None:
    """The live view folds typed records, read back from metrics.jsonl's JSON with the one parse function."""
    from astraflow.launcher.progress import RunProgress
    from astraflow.records.control import ControlRecordError, parse_control

    p = RunProgress(run="r", steps=5, policies=["solver", "verifier"])
    for rec in _metrics(tmp_path / "m.jsonl"):
        p.update(parse_control(None, None, rec))
    p.update(dataflow_counters({"tasks.emitted": 9, "trajectories.dropped.stale": 2, "tasks.expired": 0}))
    p.update(parse_control(None, None, autoscale_report(default=(1, 2)).to_json()))
    assert p.autoscale is not None and p.autoscale.pools["default"].target_nodes == 2
    assert p.dataflow is not None and p.dataflow.counters["tasks.emitted"] == 9
    assert p.trainers["verifier"].step == 5 and "solver" in p.done and not p.all_done
    assert p.dropped() == {"trajectories.dropped.stale": 2}
    line = p.summary_line()
    assert "solver: step 5/5 v5 reward 0.700 len 35/64 cut 10% busy 77% done" in line, line
    assert "trajectories.dropped.stale=2" in line and "WARNING" not in line
    p.update(trainer_done("verifier", 5))
    assert p.all_done
    p.update(parse_control(None, None, restart("raas-default-0").to_json()))
    assert p.restarts == {"raas-default-0": 1} and "restarts raas-default-0=1" in p.summary_line()
    assert list(p.nodes) == ["raas-default-0"] and p.nodes["raas-default-0"].tokens_per_s == 305
    with pytest.raises(ControlRecordError, match="tokens_per_s"):  # a node's status without its rate
        parse_control(None, None, {k: v for k, v in node_status().to_json().items() if k != "tokens_per_s"})
    with pytest.raises(ControlRecordError):  # a user's own figures: no record kind of ours
        parse_control(None, None, {"component": "my-evaluator", "accuracy": 0.5})


def test_progress_warns_when_most_responses_are_cut_and_splits_tokens_per_pool() -> None:
    from astraflow.launcher.progress import RunProgress

    p = RunProgress(run="r", steps=5, policies=["policy"])
    p.update(trainer_step("policy", 1, truncated_frac=0.61, response_len_mean=128.0, response_len_max=128))
    p.update(node_status("raas-easy-0", pool="easy", tokens_per_s=300))
    p.update(node_status("raas-hard-0", pool="hard", tokens_per_s=120))
    line = p.summary_line()
    assert "cut 61%" in line and "WARNING most responses of policy cut at max_new_tokens" in line, line
    assert "nodes 2 420 tok/s (easy 300, hard 120)" in line, line
    p.update(trainer_step("policy", 2, truncated_frac=0.0))
    assert "WARNING" not in p.summary_line() and p.mostly_cut() == []


def test_done_of_an_earlier_life_does_not_end_a_resumed_run() -> None:
    """Resuming with a larger ``--steps`` reads the durable log from its start: the first life's
    ``done`` at step 3 must not end a run whose target is 6."""
    from astraflow.launcher.progress import RunProgress

    p = RunProgress(run="r", steps=6, policies=["policy"])
    p.update(trainer_done("policy", 3))
    assert not p.all_done
    p.update(trainer_done("policy", 6))
    assert p.all_done
    # A rollback's launch reads a "done" at the target step written before it started: history too.
    rolled_back = RunProgress(run="r", steps=6, policies=["policy"], done_since=201.0)  # the record says 200.0
    rolled_back.update(trainer_done("policy", 6))
    assert not rolled_back.all_done


# -- launch() against the real broker, with stand-in components -------------------------------
def _fake_specs(tmp_path: Path, crash: bool):
    def specs(recipe, recipe_file, cluster_file, run_dir, **_options):
        out = [_spec(run_dir, "dataflow", SLEEPER), _spec(run_dir, "raas-default-0", SLEEPER)]
        if crash:
            out.append(_spec(run_dir, "trainer-policy",
                             "import time, sys; time.sleep(1.5); print('CUDA out of memory'); sys.exit(7)",
                             may_exit=True))
        return out
    return specs


def _recipe(tmp_path: Path):
    from astraflow.recipe import Recipe

    return Recipe.load(Path(__file__).parent.parent / "examples" / "recipes" / "math.yaml")


@pytest.mark.integration
def test_launch_interrupted_leaves_nothing_behind(tmp_path: Path, test_cluster, monkeypatch) -> None:
    from rich.console import Console

    from astraflow.launcher import RunOptions, launch, runner

    monkeypatch.setattr(runner, "component_specs", _fake_specs(tmp_path, crash=False))
    opts = RunOptions(run_id=test_cluster.run, runs_dir=tmp_path, grace_s=3, live=False)
    # Ctrl+C arrives as KeyboardInterrupt in the main thread, exactly what the terminal does.
    timer = threading.Timer(8.0, _thread.interrupt_main)
    timer.start()
    try:
        result = launch(_recipe(tmp_path), test_cluster, opts, Console(quiet=True))
    finally:
        timer.cancel()
    assert result.returncode == 130 and result.reason == "interrupted"
    run_dir = tmp_path / test_cluster.run
    pids = _pids_from_log(run_dir / "logs/dataflow.log") + _pids_from_log(run_dir / "logs/raas-default-0.log")
    assert not any(pid_alive(p) for p in pids)
    assert (run_dir / "metrics.jsonl").exists() and result.report_path == run_dir / "report.png"
    # an interrupted run's picture is drawn by a detached process after the launcher returns
    wait_until(lambda: (run_dir / "report.png").exists(), 60, "report.png of the interrupted run")
    assert (run_dir / "recipe.yaml").exists() and oct((run_dir / "cluster.yaml").stat().st_mode)[-3:] == "600"


@pytest.mark.integration
def test_launch_fails_when_a_restart_budget_is_exhausted(tmp_path: Path, test_cluster, monkeypatch) -> None:
    """A component that keeps dying is restarted within its budget, then fails the run by name."""
    from rich.console import Console

    from astraflow.launcher import RunOptions, launch, runner
    from astraflow.report import load_metrics

    monkeypatch.setattr(runner, "component_specs", _fake_specs(tmp_path, crash=True))
    opts = RunOptions(run_id=test_cluster.run, runs_dir=tmp_path, grace_s=3, live=False, timeout_s=60,
                      restart=RestartPolicy(backoff_initial_s=0.1, max_restarts=2))
    result = launch(_recipe(tmp_path), test_cluster, opts, Console(quiet=True))
    assert result.returncode == 1 and result.restarts == {"trainer-policy": 2}
    log = tmp_path / test_cluster.run / "logs" / "trainer-policy.log"
    assert "'trainer-policy' exited with status 7 unexpectedly after 2 restarts" in result.reason
    assert "restart budget exhausted" in result.reason and str(log) in result.reason
    assert "CUDA out of memory" in result.reason
    run_dir = tmp_path / test_cluster.run
    records = [r for r in typed_records(load_metrics(run_dir / "metrics.jsonl")) if isinstance(r, SupervisorEvent)]
    assert [(r.component, r.event, r.returncode, r.restarts) for r in records] == [
        ("trainer-policy", "restart", 7, 1), ("trainer-policy", "restart", 7, 2), ("trainer-policy", "failed", 7, 2)]
    pids = _pids_from_log(run_dir / "logs/dataflow.log") + _pids_from_log(run_dir / "logs/raas-default-0.log")
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.integration
def test_second_sigterm_during_the_stop_is_ignored(tmp_path: Path, test_cluster, monkeypatch) -> None:
    """SIGTERM stops the run like Ctrl+C; another one while the children are being stopped (one
    ignores SIGTERM, so the stop lasts the grace period) neither raises nor cuts the stop short."""
    from rich.console import Console

    from astraflow.launcher import RunOptions, launch, runner

    def specs(recipe, recipe_file, cluster_file, run_dir, **_options):
        return [_spec(run_dir, "dataflow", SLEEPER, "--ignore-term"), _spec(run_dir, "raas-default-0", SLEEPER)]

    monkeypatch.setattr(runner, "component_specs", specs)
    run_dir = tmp_path / test_cluster.run
    sent = []

    def terminate_twice() -> None:
        # Both components started: each sleeper prints its pids after installing its SIGTERM handler.
        _pids_from_log(run_dir / "logs/dataflow.log")
        _pids_from_log(run_dir / "logs/raas-default-0.log")
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            sent.append(time.monotonic())
            time.sleep(1.0)  # deliberate: the second SIGTERM comes 1 s into the stop, not at once

    opts = RunOptions(run_id=test_cluster.run, runs_dir=tmp_path, grace_s=3, live=False, timeout_s=60)
    thread = threading.Thread(target=terminate_twice, daemon=True)
    thread.start()
    result = launch(_recipe(tmp_path), test_cluster, opts, Console(quiet=True))
    thread.join()
    assert result.returncode == 130 and result.reason == "interrupted" and len(sent) == 2
    pids = _pids_from_log(run_dir / "logs/dataflow.log") + _pids_from_log(run_dir / "logs/raas-default-0.log")
    assert not any(pid_alive(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the launcher's handler was left installed"


@pytest.mark.integration
def test_stack_watch_restarts_a_dead_server_then_gives_up(tmp_path: Path) -> None:
    """The embedded stack a run started: a killed broker comes back on the same port (the run's
    topics re-ensured), and one more death past the budget fails, naming the server and its log."""
    from astraflow.embedded import EmbeddedStack
    from astraflow.embedded.tansu import kafka_answers
    from astraflow.launcher.stack_watch import StackWatch

    stack, up = EmbeddedStack.start_private(tmp_path / "state", storage="memory")
    try:
        broker_restarts = []
        watch = StackWatch(stack, RestartPolicy(backoff_initial_s=0.1, max_restarts=1),
                           on_broker_restart=lambda: broker_restarts.append(1))
        assert watch.check() == []
        stack.kafka.kill()
        deadline = time.monotonic() + 30  # for both waits together
        (event,) = wait_until(watch.check, 30, "the stack watch to restart the killed broker")
        assert (event.name, event.returncode, event.restarts) == ("tansu", None, 1) and event.pid == stack.kafka.pid()
        assert kafka_answers(up.endpoints["kafka_bootstrap"]) and broker_restarts == [1] and stack.s3.alive()
        assert "supervisor: tansu died; restart 1 in 0.1 s" in stack.kafka.log_file.read_text()
        stack.kafka.kill()
        with pytest.raises(ChildExited) as exc:
            wait_until(lambda: watch.check() and False, max(0.0, deadline - time.monotonic()),
                       "watch.check() to raise ChildExited")
        assert "'tansu' died unexpectedly after 1 restarts" in str(exc.value)
        assert str(stack.kafka.log_file) in str(exc.value) and watch.restarts() == {"tansu": 1}
    finally:
        stack.down()


def test_components_share_the_cores_among_trainers_and_nodes() -> None:
    from astraflow.launcher.plan import child_env, threads_per_component
    from astraflow.recipe import Recipe

    recipes = Path(__file__).parent.parent / "examples" / "recipes"
    math = Recipe.load(recipes / "math.yaml")  # one trainer, one node
    two = Recipe.load(recipes / "solver_verifier.yaml")  # two trainers, one node
    assert [threads_per_component(math, cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert [threads_per_component(two, cores) for cores in (2, 16)] == [1, 5]
    bigger = math.model_copy(update={"pools": [math.pools[0].model_copy(update={"nodes": 3})]})
    assert threads_per_component(bigger, 16) == 4
    env = child_env(Path("cluster.yaml"), "r", threads_per_component(math, 16))
    assert env["OMP_NUM_THREADS"] == env["ASTRAFLOW_TORCH_THREADS"] == "8"


def test_a_recipe_placing_models_on_a_missing_gpu_is_refused_naming_the_fields(tmp_path: Path) -> None:
    import torch

    from astraflow.launcher.plan import unavailable_devices
    from astraflow.recipe import Recipe

    recipes = Path(__file__).parent.parent / "examples" / "recipes"
    assert unavailable_devices(Recipe.load(recipes / "math.yaml")) == []  # all on the CPU: torch not even needed
    on_gpu = Recipe.load(recipes / "math_cuda.yaml")
    missing = unavailable_devices(on_gpu)
    if torch.cuda.is_available():
        assert missing == []
    else:
        assert [m.split(" is ")[0] for m in missing] == ["policies.0.backend.device", "pools.0.engine.device"]
        assert all("sees no CUDA device" in m for m in missing)
    far = on_gpu.model_copy(update={"pools": [on_gpu.pools[0].model_copy(update={
        "engine": on_gpu.pools[0].engine.model_copy(update={"device": "cuda:64"})})]})
    assert [m.split(" is ")[0] for m in unavailable_devices(far)][-1] == "pools.0.engine.device"
    if not torch.cuda.is_available():
        # `astraflow run` says so before it starts a stack or a component
        state = tmp_path / "state"
        proc = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", str(recipes / "math_cuda.yaml"),
                               "--no-live", "--state-dir", str(state), "--runs-dir", str(tmp_path / "runs")],
                              check=False, capture_output=True, text=True, timeout=120)
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 1 and "pools.0.engine.device is 'cuda'" in out, out
        assert not state.exists() and not (tmp_path / "runs").exists()


def test_prometheus_targets_give_each_component_a_port_and_list_them(tmp_path: Path) -> None:
    """One port per component name, kept for a node started anew under the same name (the actuator),
    and prometheus.json (file_sd format) rewritten as components come."""
    from astraflow.launcher.plan import PrometheusTargets

    targets = PrometheusTargets(tmp_path)
    a = targets.serve(ChildSpec("dataflow", ["x"], {"K": "v"}, tmp_path / "a.log"))
    b = targets.serve(ChildSpec("raas-p-0", ["y"], {}, tmp_path / "b.log"))
    again = targets.serve(ChildSpec("raas-p-0", ["y"], {}, tmp_path / "b.log"))
    port_a, port_b = int(a.env["ASTRAFLOW_PROMETHEUS_PORT"]), int(b.env["ASTRAFLOW_PROMETHEUS_PORT"])
    assert a.env["K"] == "v" and a.env["ASTRAFLOW_PROMETHEUS_HOST"] == "127.0.0.1" and port_a != port_b
    assert again.env == b.env
    assert json.loads((tmp_path / "prometheus.json").read_text()) == [
        {"targets": [f"127.0.0.1:{port_a}"], "labels": {"component": "dataflow"}},
        {"targets": [f"127.0.0.1:{port_b}"], "labels": {"component": "raas-p-0"}}]
