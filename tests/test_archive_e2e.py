"""Acceptance: after a short ``astraflow run`` (the archiver started by default), ``<run>/archive/``
holds every trained trajectory, and DuckDB and polars read it straight from the bucket — also when
the archiver was SIGKILLed mid-run and restarted by the launcher: nothing lost, nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import LauncherProcess, launcher_env, leftover_processes
from process_helpers import children, pid_alive

from astraflow.archive.readers import archive_url, duckdb_connect, polars_storage_options
from astraflow.archive.replay import ArchivedRun
from astraflow.launcher.cluster import write_cluster_file
from astraflow.log import Topics
from astraflow.log.lag import committed_offsets
from astraflow.objstore import ObjectStore
from astraflow.records.control import DataflowCounters, NodeStatus, SupervisorEvent, TrainerDone, TrainerStep
from astraflow.report.plot import typed_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]
duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")

STEPS = 40
"""Long enough for the archiver killed at step 1 to be restarted (1 s backoff) while the run goes on: a
tiny step takes ~0.1 s on a quiet machine, and 10 steps ended before the restart."""
ROW_KEY = {"trajectories": "episode_id", "batches": "position", "weights": "0", "metrics": "0"}
"""What tells the rows of one log record apart, per archive kind."""


def _archiver_pid(launcher: LauncherProcess, *, other_than: int | None = None, timeout_s: float = 30.0) -> int:
    """The launcher's archiver child (argv ``python -m astraflow.cli.main --config F archive ...``; the
    run's paths hold the test's name, so the subcommand is matched as a whole argv element), waiting
    while there is none or only ``other_than`` (a restart in progress)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert launcher.proc.poll() is None, f"launcher ended early:\n{launcher.output[-3000:]}"
        pids = [pid for pid, argv in children(launcher.proc.pid).items()
                if "astraflow.cli.main" in argv and "archive" in argv[argv.index("astraflow.cli.main"):]]
        assert len(pids) <= 1, children(launcher.proc.pid)
        if pids and pids[0] != other_than:
            return pids[0]
        assert time.monotonic() < deadline, f"no (new) archiver after {timeout_s} s: {children(launcher.proc.pid)}"
        time.sleep(0.1)


def test_run_leaves_an_archive_duckdb_and_polars_read(tmp_path: Path, test_cluster) -> None:
    """One run whose archiver is SIGKILLed at trainer step 1 (trajectories flowing, rows buffered and
    not committed) and restarted by the launcher. Afterwards every record of the log up to the
    archiver's committed offsets is archived exactly once, the archive holds every trajectory the
    dataflow received and every trained batch, DuckDB and polars agree, and the offline replay of the
    archive gives the online dataflow's counters."""
    cfg = test_cluster
    cluster_file = write_cluster_file(cfg, tmp_path / "cluster.yaml")
    launcher = LauncherProcess(tmp_path, cfg.run, launcher_env(cluster_file), STEPS, timeout_s=150, grace_s=15)
    launcher.wait_for_step(1, timeout_s=90)
    victim = _archiver_pid(launcher)
    os.kill(victim, signal.SIGKILL)
    _archiver_pid(launcher, other_than=victim)  # restarted while the run goes on (not at its stop)
    rc = launcher.wait(150)
    out = launcher.output
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out and "restarts archive=1" in out, out[-2000:]
    run_dir = launcher.run_dir
    log = (run_dir / "logs" / "archive.log").read_text()
    assert "supervisor: archive was killed by signal 9 (SIGKILL); restart 1" in log, log[-2000:]
    assert '"rows"' in log.rsplit("supervisor:", 1)[1], log[-2000:]  # the restarted one stopped cleanly
    assert not pid_alive(victim)
    records = typed_records(launcher.records())
    restarts = [(r.component, r.event, r.returncode, r.restarts) for r in records if isinstance(r, SupervisorEvent)]
    assert restarts == [("archive", "restart", -signal.SIGKILL, 1)], restarts
    step_records = [r for r in records if isinstance(r, TrainerStep)]  # reward_mean, publish_bytes, ... typed
    assert max(r.step for r in step_records) == STEPS
    # What any run leaves (this test is also the plain `astraflow run` end-to-end check).
    assert any(isinstance(r, TrainerDone) for r in records) and any(isinstance(r, NodeStatus) for r in records)
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("dataflow", "trainer-policy", "raas-default-0"):
        assert (run_dir / "logs" / f"{name}.log").exists()
    assert leftover_processes(str(run_dir)) == []
    counters = [r for r in records if isinstance(r, DataflowCounters)][-1].counters
    batched = sum(v for k, v in counters.items() if k.endswith(".trajectories_batched"))
    assert batched > 0

    # Exactly once against the log itself: per kind and log partition the archived offsets are
    # 0..n-1, n the archiver group's committed offset (nothing skipped), and no row is there twice;
    # on the trajectories topic n reaches at least as far as the online dataflow read.
    con = duckdb_connect(cfg)
    topics = Topics(cfg.run)
    committed = committed_offsets(cfg, f"{cfg.run}.archive")
    consumed = ArchivedRun(ObjectStore.from_config(cfg), cfg.run).dataflow_consumed()
    assert consumed and all(committed.get((topics.trajectories, p), 0) >= o for p, o in consumed.items()), \
        (consumed, committed)
    for kind, topic in (("trajectories", topics.trajectories), ("batches", topics.batches("policy")),
                        ("weights", topics.weights("policy")), ("metrics", topics.metrics)):
        rows = con.execute(
            f"SELECT log_partition, count(*), count(DISTINCT (log_offset, {ROW_KEY[kind]})), "
            f"count(DISTINCT log_offset), max(log_offset) + 1 "
            f"FROM read_parquet('{archive_url(cfg, kind)}', hive_partitioning = true) GROUP BY ALL").fetchall()
        archived = {partition: (n_rows, n_distinct, n_offsets, end) for partition, n_rows, n_distinct, n_offsets, end
                    in rows}
        expected = {p: n for (t, p), n in committed.items() if t == topic and n > 0}
        assert set(archived) == set(expected), (kind, archived, expected)
        for partition, (n_rows, n_distinct, n_offsets, end) in archived.items():
            assert n_rows == n_distinct, (kind, partition, n_rows, n_distinct)  # no row twice
            assert n_offsets == end == expected[partition], (kind, partition, n_offsets, end, expected)

    trajs = f"read_parquet('{archive_url(cfg, 'trajectories')}', hive_partitioning = true)"
    batches = f"read_parquet('{archive_url(cfg, 'batches')}', hive_partitioning = true)"
    n_traj, n_ids = con.execute(f"SELECT count(*), count(DISTINCT episode_id) FROM {trajs}").fetchone()
    assert n_traj == n_ids >= counters["trajectories.received"]
    (n_batched,) = con.execute(f"SELECT count(*) FROM {batches}").fetchone()
    assert n_batched == batched  # every trained trajectory's batch composition
    (missing,) = con.execute(f"SELECT count(*) FROM {batches} b ANTI JOIN {trajs} t USING (episode_id)").fetchone()
    assert missing == 0  # ... and every trained trajectory itself
    (policy,) = con.execute(f"SELECT DISTINCT policy FROM {trajs}").fetchone()
    assert policy == "policy"
    (versions,) = con.execute(f"SELECT count(*) FROM read_parquet('{archive_url(cfg, 'weights')}')").fetchone()
    assert versions >= 2

    lf = pl.scan_parquet(archive_url(cfg, "trajectories"), storage_options=polars_storage_options(cfg),
                         hive_partitioning=True)
    df = lf.select(pl.len().alias("n"), pl.col("episode_id").n_unique().alias("ids")).collect()
    assert df.row(0) == (n_traj, n_ids)

    # Offline replay through the dataflow's own code, up to where the online dataflow read: the run's
    # configuration gives the online counts
    replay = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "replay", cfg.run, "--recipe", str(run_dir / "recipe.yaml"),
         "--variant", "dapo={filters: [dynamic_sampling]}", "--variant", "fresh={max_staleness: 0}",
         "--plot", str(tmp_path / "replay.png"), "--json"],
        check=False, env=launcher_env(cluster_file), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr[-3000:]
    report = json.loads(replay.stdout.splitlines()[-1])
    own, dapo, fresh = report["configurations"]
    print(json.dumps({"online": {k: v for k, v in counters.items() if k.startswith("trajectories.")},
                      "replay": own}, indent=1))
    for key in ("received", "kept", "stale", "in_dropped_group", "duplicate"):
        online_value = counters.get(f"trajectories.{key}", 0)
        replayed = own[key] if key in own else own["dropped"][key]
        assert replayed == online_value, (key, replayed, online_value)
    assert dapo["zero_variance_groups"] == 0 and dapo["kept"] <= own["kept"]
    assert fresh["dropped"]["stale"] >= own["dropped"]["stale"]
    assert (tmp_path / "replay.png").stat().st_size > 0

    # The same replay from the run's topics instead of its archive: the same counts.
    live = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "replay", cfg.run, "--recipe", str(run_dir / "recipe.yaml"),
         "--from-log", "--no-plot", "--json"],
        check=False, env=launcher_env(cluster_file), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert live.returncode == 0, live.stderr[-3000:]
    live_report = json.loads(live.stdout.splitlines()[-1])
    (live_own,) = live_report["configurations"]
    for key in ("received", "kept", "dropped", "batches", "trajectories_batched", "groups_dropped"):
        assert live_own[key] == own[key], (key, live_own[key], own[key])
    assert live_report["online"] == report["online"]
