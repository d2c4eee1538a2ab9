"""What the end-to-end tests share: a tiny recipe (``tiny_recipe``), the environment that points a
launched ``astraflow`` at the test cluster (``launcher_env``), ``astraflow run`` as a subprocess with the
probes the supervision tests need (``LauncherProcess``), and the processes a run may leave behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from process_helpers import children
from waiting import wait_until

from astraflow.embedded.ports import StackPorts
from astraflow.records.control import TRAINER_RECORDS
from astraflow.report.plot import typed_records

ROOT = Path(__file__).parent.parent


def tiny_recipe(tmp_path: Path, source: str = "math", steps: int = 2, extra: dict | None = None,
                trainer: dict | None = None) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "recipes" / f"{source}.yaml").read_text())
    data.update(extra or {})
    data["dataset"]["samples"] = 4
    data["dataflow"]["groups_per_batch"] = 4
    data["trainer"].update(steps=steps, checkpoint_every=1, **(trainer or {}))
    data["eval"]["prompts"] = 20
    for p in data["policies"]:
        p["model"] = str(ROOT / "examples" / "models" / "tiny.yaml")
        p["sft"]["steps"] = 5
    path = tmp_path / f"tiny-{source}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launcher_env(cluster_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(cluster_file)
    return env


def leftover_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


# -- supervision: kill a component mid-run, stop the launcher mid-run ---------------------------
class LauncherProcess:
    """``astraflow run`` as a subprocess (output to a file: a full pipe would block it), with the
    probes the supervision tests need."""

    def __init__(self, tmp_path: Path, run_id: str, env: dict[str, str], steps: int, timeout_s: float = 100,
                 grace_s: float = 5, extra_args: tuple[str, ...] = (), recipe_extra: dict | None = None,
                 trainer: dict | None = None) -> None:
        self.run_dir = tmp_path / "runs" / run_id
        self.out_path = tmp_path / "launcher.out"
        recipe = tiny_recipe(tmp_path, steps=steps, extra=recipe_extra, trainer=trainer)
        cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe),
               "--run-id", run_id, "--runs-dir", str(tmp_path / "runs"), "--no-live", "--timeout", str(timeout_s),
               "--grace", str(grace_s), *extra_args]
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    @property
    def output(self) -> str:
        """What the launcher printed, with rich's line wrapping undone."""
        return " ".join(self.out_path.read_text().split())

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for_step(self, step: int, timeout_s: float = 60.0) -> None:
        """Until a trainer step record >= ``step`` reached metrics.jsonl: the kill point."""
        def reached() -> bool:
            assert self.proc.poll() is None, f"launcher ended early:\n{self.output[-3000:]}"
            return any(isinstance(r, TRAINER_RECORDS) and r.step >= step for r in typed_records(self.records()))

        wait_until(reached, timeout_s, f"trainer step {step} in metrics.jsonl", interval_s=0.1,
                   on_timeout=lambda: self.output[-3000:])

    def component_pid(self, name: str) -> int:
        """The pid of the component ``name`` (``dataflow``, ``trainer-policy``, ``raas-default-0``)."""
        command = name.split("-")[0]
        pids = [pid for pid, argv in children(self.proc.pid).items() if command in argv]
        assert len(pids) == 1, f"{name}: {children(self.proc.pid)}"
        return pids[0]

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launcher still running after {timeout_s} s:\n{self.output[-3000:]}") from None


def free_block_plan() -> StackPorts:
    """Free ports for the layout `astraflow up` takes (`--kafka-port`, `--s3-port`, `--internal-port-base`): kafka, s3, base..base+9 and base+10009."""
    for _ in range(200):
        candidate = StackPorts.free()
        plan = StackPorts.plan(candidate.kafka, candidate.s3, candidate.master)
        if plan.master + 10009 <= 65535 and not plan.taken():
            return plan
    raise RuntimeError("no free port block")
