"""End to end: ``astraflow run`` and ``astraflow demo`` on the real broker and bucket, with the real
components as separate processes, on a tiny recipe for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.launcher.cluster import write_cluster_file

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def tiny_recipe(tmp_path: Path, source: str = "math", steps: int = 2) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "recipes" / f"{source}.yaml").read_text())
    data["dataset"]["samples"] = 4
    data["dataflow"]["groups_per_batch"] = 4
    data["trainer"].update(steps=steps, checkpoint_every=1)
    data["eval"]["prompts"] = 20
    for p in data["policies"]:
        p["model"] = str(ROOT / "examples" / "models" / "tiny.yaml")
        p["sft"]["steps"] = 5
    path = tmp_path / f"tiny-{source}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _env(cluster_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(cluster_file)
    return env


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_astraflow_run_tiny_recipe(tmp_path: Path, test_cluster) -> None:
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    recipe = tiny_recipe(tmp_path)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id", test_cluster.run,
           "--runs-dir", str(tmp_path / "runs"), "--no-live", "--timeout", "80", "--grace", "5"]
    proc = subprocess.run(cmd, check=False, env=_env(cluster_file), capture_output=True, text=True, timeout=110, cwd=tmp_path)
    run_dir = tmp_path / "runs" / test_cluster.run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("component") == "trainer" and not r.get("event") and "step" in r]
    assert max(r["step"] for r in steps) == 2
    assert all("reward_mean" in r and "publish_bytes" in r for r in steps)
    assert any(r.get("event") == "done" for r in records)
    assert any(r.get("component") == "raas" for r in records)
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("dataflow", "trainer-policy", "raas-default-0"):
        assert (run_dir / "logs" / f"{name}.log").exists()
    assert _leftovers(str(run_dir)) == []


def test_astraflow_demo_tiny(tmp_path: Path, test_cluster) -> None:
    """The demo's whole path (SFT, v0 publish, eval, launcher, pull, eval) on a tiny budget: it must
    run and report measured figures; learning itself is the demo's job, not this test's."""
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    recipe = tiny_recipe(tmp_path)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "demo", "--recipes", str(recipe), "--steps", "2",
           "--runs-dir", str(tmp_path / "runs"), "--no-live"]
    proc = subprocess.run(cmd, check=False, env=_env(cluster_file), capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary_path,) = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    row = summary["policies"]["policy"]
    assert row["before"]["n"] == row["after"]["n"] == 20
    assert 0.0 <= row["before"]["accuracy"] <= 1.0 and row["final_version"] >= 2
    assert abs(row["delta"] - (row["after"]["accuracy"] - row["before"]["accuracy"])) < 1e-9
    assert "held-out accuracy" in proc.stdout and (summary_path.parent / "report.png").exists()
