"""Acceptance: after a short ``astraflow run`` (the archiver started by default), ``<run>/archive/``
holds every trained trajectory, and DuckDB and polars read it straight from the bucket."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher_e2e import _env, tiny_recipe

from astraflow.archive.readers import archive_url, duckdb_connect, polars_storage_options
from astraflow.launcher.cluster import write_cluster_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]
duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")


def test_run_leaves_an_archive_duckdb_and_polars_read(tmp_path: Path, test_cluster) -> None:
    cfg = test_cluster
    cluster_file = write_cluster_file(cfg, tmp_path / "cluster.yaml")
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(tiny_recipe(tmp_path)), "--run-id", cfg.run,
           "--runs-dir", str(tmp_path / "runs"), "--no-live", "--timeout", "80", "--grace", "8"]
    proc = subprocess.run(cmd, check=False, env=_env(cluster_file), capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / cfg.run
    log = (run_dir / "logs" / "archive.log").read_text()
    assert '"rows"' in log, log[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counters = [r for r in records if r.get("component") == "dataflow" and r.get("kind") == "dataflow"][-1]["counters"]
    batched = sum(v for k, v in counters.items() if k.endswith(".trajectories_batched"))
    assert batched > 0

    con = duckdb_connect(cfg)
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
        check=False, env=_env(cluster_file), capture_output=True, text=True, timeout=120, cwd=tmp_path)
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
