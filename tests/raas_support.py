"""Helpers (no tests) of the RaaS / trainer component tests (real broker + real S3): recipes, records,
subprocess components, and readers of the trajectories / metrics topics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = str(REPO / "examples" / "models" / "tiny.yaml")


def recipe_dict(run: str, **over) -> dict:
    d = {
        "run": run,
        "seed": 0,
        "dataset": {"type": "minmax", "samples": 2, "pool": "default"},
        "workflow": {"type": "math", "policy": "policy"},
        "policies": [{"name": "policy", "model": TINY_MODEL, "backend": {"lr": 1e-3}}],
        "pools": [{"name": "default", "concurrency": 2}],
        "sampling": {"policy": {"max_new_tokens": 4}},
        "trainer": {"steps": 6, "checkpoint_every": 2, "anchor_every": 10, "max_publish_lag": 2},
    }
    d.update(over)
    return d


def load_tiny_model():
    """A fresh copy of the demo's tiny model, from its materialised checkpoint directory."""
    from astraflow.models import load_model, resolve_checkpoint

    return load_model(resolve_checkpoint(TINY_MODEL))


def make_recipe(run: str, **over):
    from astraflow.recipe import Recipe

    return Recipe.model_validate(recipe_dict(run, **over))


def write_files(tmp_path: Path, cfg, recipe: dict) -> tuple[Path, Path]:
    """Cluster config and recipe as YAML files for a component subprocess."""
    cfg_path, recipe_path = tmp_path / "cluster.yaml", tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    recipe_path.write_text(yaml.safe_dump(recipe))
    return cfg_path, recipe_path


def start_component(args: list[str], cfg_path: Path, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", ASTRAFLOW_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith("ASTRAFLOW_") and k not in ("ASTRAFLOW_TORCH_THREADS",)]:
        del env[k]  # the config file is the only source of endpoints
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "--config", str(cfg_path), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


def publish_v0(cfg, policy: str = "policy"):
    """What the trainer's bootstrap does when nothing exists: the seeded model as v0."""
    from astraflow.delta.publisher import WeightPublisher

    model = load_tiny_model()
    pub = WeightPublisher(cfg, policy, anchor_every=10)
    pub.publish(model.state_dict(), 0)
    pub.flush()
    return pub, model


def send_tasks(cfg, n: int, prefix: str, samples: int = 2, pool: str = "default") -> list[str]:
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.records import Task, task
    from astraflow.tasks import build_dataset

    topic = Topics(cfg.run).tasks(pool)
    ensure_topics(cfg, {topic: 4})
    problems = build_dataset({"type": "minmax", "seed": 0}).problems("train", n, seed=hash(prefix) % 1000)
    ids = []
    with LogProducer(cfg, f"test-{uuid.uuid4().hex[:6]}") as prod:
        for i, p in enumerate(problems):
            t = Task(prompt_id=f"{prefix}-{i}", prompt=p.prompt, answer=p.answer, samples=samples, pool=pool)
            prod.send_table(topic, t.prompt_id, task.to_table([t]), task.SCHEMA_NAME, task.SCHEMA_VERSION)
            ids.append(t.prompt_id)
        prod.flush(30)
    return ids


class TopicReader:
    """Reads a run's trajectories (or metrics) topic from the beginning with a group of its own."""

    def __init__(self, cfg, topic: str) -> None:
        from astraflow.log import LogConsumer

        self.consumer = LogConsumer(cfg, topic, f"test-reader-{uuid.uuid4().hex[:8]}")
        self.items: list = []
        self.records: list = []
        """The typed control records among the items (``Message.record``, parsed at decode)."""

    def read(self, timeout_s: float = 0.5) -> list:
        from astraflow.records import trajectory

        new = []
        for m in self.consumer.poll(timeout_s=timeout_s, max_records=500):
            new.extend(trajectory.from_table(m.table) if m.table is not None else [m.obj])
            if m.record is not None:
                self.records.append(m.record)
        self.consumer.commit()
        self.items.extend(new)
        return new

    def until(self, predicate, timeout_s: float, what: str, alive=None) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.items):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
            if alive is not None:
                alive()
            self.read()

    def close(self) -> None:
        self.consumer.close()


def trainer_batch(policy: str, batch_id: str, groups: int = 2, samples: int = 2):
    from astraflow.records import Batch, Trajectory

    trajs = []
    for g in range(groups):
        prompt = [1, 5 + g, 6, 7]
        for s in range(samples):
            resp = [8 + s, 9, 2]
            trajs.append(Trajectory(
                episode_id=f"{batch_id}-{g}/{policy}/{s}", task_id=f"{batch_id}-{g}",
                group_id=f"{batch_id}-{g}/{policy}", sample_index=s, policy=policy, prompt_ids=prompt,
                response_ids=resp, logprobs=[-2.0] * 3, versions=[0] * 3, loss_mask=[1] * 3,
                reward=float(s % 2)))
    return Batch(batch_id=batch_id, policy=policy, trainer_version=0, trajectories=trajs)


def send_batches(cfg, ids: list[str], policy: str = "policy") -> None:
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.records import batch

    topic = Topics(cfg.run).batches(policy)
    ensure_topics(cfg, {topic: 1})
    with LogProducer(cfg, f"test-{uuid.uuid4().hex[:6]}") as prod:
        for i in ids:
            prod.send_table(topic, i, batch.to_table(trainer_batch(policy, i)), batch.SCHEMA_NAME, batch.SCHEMA_VERSION)
        prod.flush(30)
