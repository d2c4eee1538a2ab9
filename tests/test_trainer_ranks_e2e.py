"""End to end: ``astraflow run`` of the demo's math recipe (tiny settings) with a 2-rank trainer
(torch.distributed.run, FSDP2 on gloo) on the real broker and bucket: the run finishes, and the node
serves the versions the group published (each rank its own rows: two parts a version), bit-exactly; a SIGKILLed rank restarts the whole group from
its checkpoint and the run finishes without training a checkpointed batch twice."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from e2e_helpers import LauncherProcess, launcher_env, tiny_recipe
from process_helpers import children, pid_alive
from run_records import read_trajectories, teacher_forced

from astraflow.launcher.cluster import write_cluster_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class RankGroupRun(LauncherProcess):
    """``astraflow run`` of the tiny math recipe with ``trainer.ranks: 2``."""

    def __init__(self, tmp_path: Path, run_id: str, env: dict[str, str], steps: int, timeout_s: float = 200) -> None:
        recipe = tiny_recipe(tmp_path, steps=steps)
        data = yaml.safe_load(recipe.read_text())
        data["trainer"]["ranks"] = 2
        recipe.write_text(yaml.safe_dump(data))
        self.run_dir = tmp_path / "runs" / run_id
        self.out_path = tmp_path / "launcher.out"
        cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id", run_id, "--runs-dir",
               str(tmp_path / "runs"), "--no-live", "--timeout", str(timeout_s), "--grace", "10"]
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def rank_pid(self, rank: int) -> int:
        """The worker process of trainer rank ``rank`` (its agent set ``RANK`` in its environment)."""
        tree, todo = {}, [self.proc.pid]
        while todo:  # launcher -> agent -> workers
            below = children(todo.pop())
            tree.update(below)
            todo += list(below)
        found = []
        for pid, argv in tree.items():
            if "trainer" not in argv or "torch.distributed.run" in argv:
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                found.append(pid)
        assert len(found) == 1, tree
        return found[0]


def _trainer_steps(records: list[dict], life: str | None = None) -> list[dict]:
    return [r for r in records if r.get("component") == "trainer" and "batch_id" in r and not r.get("event")
            and (life is None or r.get("life") == life)]


def test_a_two_rank_run_finishes_and_the_node_serves_its_weights_bit_exactly(tmp_path: Path, test_cluster) -> None:
    import torch

    from astraflow.delta import WeightSubscriber
    from astraflow.models import load_model
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore
    from astraflow.trainer.distributed import SINGLE
    from astraflow.trainer.service import publishable
    from astraflow.trainer.sharded_checkpoint import restore
    from astraflow.trainer.torch_backend import TorchBackend

    steps = 4
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    run = RankGroupRun(tmp_path, test_cluster.run, launcher_env(cluster_file), steps)
    assert run.wait(240) == 0, run.output[-3000:]
    records = run.records()
    assert [r["step"] for r in _trainer_steps(records)] == list(range(1, steps + 1))
    assert any(r.get("component") == "trainer" and r.get("event") == "done" for r in records)
    trainer_log = (run.run_dir / "logs" / "trainer-policy.log").read_text()
    assert "torch.distributed.run --nproc-per-node 2" in trainer_log
    assert "FSDP2 rank 0 of 2" in trainer_log and "FSDP2 rank 1 of 2" in trainer_log

    # the last version, as a node pulls it, is bit for bit the bf16 cast of the group's fp32 masters
    # (its last checkpoint, gathered on one rank): what a single-rank trainer publishes from that state
    recipe = yaml.safe_load((run.run_dir / "recipe.yaml").read_text())
    model = load_model(Path(recipe["policies"][0]["model"]))
    checkpoints = CheckpointStore(ObjectStore.from_config(test_cluster), test_cluster.run, "policy")
    ckpt = checkpoints.load()
    assert (ckpt.step, ckpt.version, ckpt.stored_shards.world_size) == (steps, steps, 2)
    one = TorchBackend(load_model(Path(recipe["policies"][0]["model"])), group=SINGLE)
    restore(checkpoints, ckpt, one, SINGLE)
    expected = publishable(one.state_dict(), "bfloat16")
    sub = WeightSubscriber(test_cluster, "policy", f"test-{uuid.uuid4().hex[:8]}", register=False)
    try:
        assert sub.latest_version() == steps
        # each rank published its own rows of every version (two parts, no gather)
        assert all(len(sub.store.manifest(v).parts) == 2 for v in range(steps + 1))
        served, _, _ = sub.pull(steps)
        assert sorted(served) == sorted(expected)
        assert all(torch.equal(served[k], expected[k]) for k in expected)
        # and the node generated with the versions it pulled: its log-probs are the served weights'
        node_log = (run.run_dir / "logs" / "raas-default-0.log").read_text()
        assert max(int(v) for v in re.findall(r"policy -> v(\d+) in", node_log)) >= 1, node_log[-2000:]
        by_version: dict[int, list] = {}
        for t in read_trajectories(test_cluster):
            if len(set(t.versions)) == 1:
                by_version.setdefault(t.versions[0], []).append(t)
        assert any(v > 0 for v in by_version), sorted(by_version)
        for v in sorted(by_version):
            state, _, _ = sub.pull(v)
            model.load_state_dict({k: x.float() for k, x in state.items()}, strict=True)
            worst = max(max(abs(a - b) for a, b in zip(t.logprobs, teacher_forced(model, t.prompt_ids, t.response_ids),
                                                       strict=True)) for t in by_version[v][:8])
            assert worst < 1e-3, (v, worst)
    finally:
        sub.close()


KILL_AT, KILL_RUN_STEPS = 4, 16
"""The rank is killed at step 4 of 16: a 2-rank tiny step takes ~0.3 s, so the run is still going."""


def test_a_sigkilled_rank_restarts_the_group_without_retraining(tmp_path: Path, test_cluster) -> None:
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    run = RankGroupRun(tmp_path, test_cluster.run, launcher_env(cluster_file), KILL_RUN_STEPS, timeout_s=240)
    run.wait_for_step(KILL_AT, timeout_s=150)
    victim = run.rank_pid(1)
    first_life = {r["step"]: r["batch_id"] for r in _trainer_steps(run.records())}
    os.kill(victim, signal.SIGKILL)
    assert run.wait(240) == 0, run.output[-3000:]
    records = run.records()
    restarts = [r for r in records if r.get("kind") == "supervisor"]
    # the group is one component: its agent ended the other rank and exited, the supervisor restarted it
    assert [(r["component"], r["restarts"]) for r in restarts] == [("trainer-policy", 1)], restarts
    assert restarts[0]["returncode"] != 0
    starts = [r for r in records if r.get("component") == "trainer" and r.get("event") == "start"]
    assert len(starts) == 2 and starts[1]["origin"].startswith("checkpoint step "), starts
    resumed_at = starts[1]["step"]
    first = _trainer_steps(records, starts[0]["life"])
    second = _trainer_steps(records, starts[1]["life"])
    # every step after the checkpoint once, up to the target, and no batch the checkpoint holds again
    assert [r["step"] for r in second] == list(range(resumed_at + 1, KILL_RUN_STEPS + 1)), second
    checkpointed = {r["batch_id"] for r in first if r["step"] <= resumed_at}
    assert len(checkpointed) == resumed_at >= 1 and not checkpointed & {r["batch_id"] for r in second}
    assert set(first_life.values()) <= {r["batch_id"] for r in first}
    assert any(r.get("event") == "done" and r.get("life") == starts[1]["life"] for r in records)
    log = (run.run_dir / "logs" / "trainer-policy.log").read_text()
    assert "supervisor: trainer-policy exited with status 1; restart 1" in log, log[-3000:]
    assert not pid_alive(victim)
