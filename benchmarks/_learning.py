"""Learning runs measured as ``astraflow demo`` measures them (benchmarks/objectives.py,
benchmarks/seeds.py): a variant of a recipe (another seed, another objective) built in memory, run by
:func:`astraflow.demo.run_one` on a private embedded stack (warm start published as v0, held-out
accuracy of v0 and of the final version from the weight store, greedy), plus the trainer's per-step
figures read back from the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import yaml

from astraflow.report.plot import typed_records
from astraflow.testing.runs import trainer_steps

ROOT = Path(__file__).resolve().parent.parent


def recipe_variant(path: Path, *, run: str, seed: int | None = None, objective: dict | None = None,
                   backend: dict | None = None, dataflow: dict | None = None,
                   overrides: dict[str, str] | None = None) -> Any:
    """The recipe at ``path`` under the run name ``run``, with every seed set to ``seed`` (the recipe's,
    each policy's SFT seed; the dataset's seed is kept, so the held-out prompts are the same), each
    policy's ``backend.objective`` set to ``objective`` and its other backend options updated with
    ``backend``, and its ``dataflow`` section updated with ``dataflow``; then each ``overrides`` item (a
    dotted path into the recipe, e.g. ``dataset.samples`` or ``policies.0.sft.steps``, and its value as YAML text) set. The recipe
    validates the result, so a misspelt path is refused."""
    from astraflow.recipe import Recipe

    data = yaml.safe_load(path.read_text())
    data["run"] = run
    data.setdefault("dataflow", {}).update(dataflow or {})
    if seed is not None:
        data["seed"] = seed
    for policy in data["policies"]:
        if seed is not None and policy.get("sft"):
            policy["sft"]["seed"] = seed
        policy.setdefault("backend", {}).update(backend or {})
        if objective is not None:
            policy["backend"]["objective"] = objective
    for dotted, text in (overrides or {}).items():
        *parents, leaf = (int(k) if k.isdigit() else k for k in dotted.split("."))
        node = data
        for key in parents:  # a number indexes a list: policies.0.sft.steps
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        node[leaf] = yaml.safe_load(text)
    return Recipe.from_mapping(data, path)


def measured_run(recipe: Any, cfg: Any, runs_dir: Path, steps: int | None, console: Any,
                 window: int = 5) -> dict[str, Any]:
    """One run of ``recipe``: held-out accuracy before / after RL of each policy (``heldout``; the first
    policy's also as ``heldout_before`` / ``heldout_after``), the first policy's mean batch reward over the first and the last ``window`` steps, and the last steps' KL to the reference and
    entropy (when reported)."""
    from astraflow.demo import DemoOptions, run_one

    summary = run_one(Path(recipe.source), cfg, DemoOptions(steps=steps, runs_dir=runs_dir, live=False), console,
                      recipe=recipe)
    policy = recipe.policies[0].name
    row = summary["policies"][policy]
    lines = (runs_dir / summary["run_id"] / "metrics.jsonl").read_text().splitlines()
    steps_seen = trainer_steps(typed_records(json.loads(line) for line in lines if line.strip()), policy)

    def mean_of(key: str, part: list) -> float | None:
        values = [getattr(r, key) for r in part if getattr(r, key) is not None]
        return round(statistics.fmean(values), 4) if values else None

    first, last = steps_seen[:window], steps_seen[-window:]
    heldout = {name: {"before": r["before"]["accuracy"], "after": (r.get("after") or {}).get("accuracy"),
                      "n": r["before"]["n"]} for name, r in summary["policies"].items()}
    for name, r in summary["policies"].items():  # a workflow's breakdown (the verifier's, by candidate kind)
        if "by_candidate" in r["before"]:
            heldout[name]["by_candidate"] = {"before": r["before"]["by_candidate"],
                                             "after": (r.get("after") or {}).get("by_candidate")}
    return {"run_id": summary["run_id"], "ok": summary["returncode"] == 0, "steps": len(steps_seen),
            "heldout": heldout,
            "rl_seconds": summary["rl_seconds"],
            "heldout_before": row["before"]["accuracy"], "heldout_after": (row.get("after") or {}).get("accuracy"),
            "heldout_n": row["before"]["n"],
            "reward_first": mean_of("reward_mean", first), "reward_last": mean_of("reward_mean", last),
            "kl_ref_last": mean_of("kl_ref", last), "entropy_first": mean_of("entropy", first),
            "entropy_last": mean_of("entropy", last)}
