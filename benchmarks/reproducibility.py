"""Does a recipe give the same result twice? ``benchmarks/reproducibility.py RECIPE`` runs it twice with
one seed in each dataflow mode asked for (``--modes sync,async``) and compares, step by step, the
trainer's figures (batch reward, loss, grad norm) and the held-out accuracy before and after RL.

A ``sync`` run is reproducible by design: each wave of tasks is sampled under one version, every
episode's draws are seeded from the recipe's seed and its task (``astraflow.workflows.seeding``), and a
batch holds its groups in group-id order, so two runs on one machine with the same thread counts
should match exactly. An ``async`` run's batches depend on which episode finishes first, and the
version each token is sampled under on when a weight swap lands: it is the baseline, expected to differ.

    python benchmarks/reproducibility.py math --modes sync,async --steps 30

Last line: one JSON object; ``identical_steps`` is how many of the steps matched in all three figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _learning import recipe_variant

from astraflow.demo import DemoOptions, recipe_path, run_one
from astraflow.report.plot import typed_records
from astraflow.testing.runs import private_cluster, trainer_steps

FIGURES = ("reward_mean", "loss", "grad_norm")


def one_run(path: Path, mode: str, label: str, steps: int | None, seed: int, cfg, runs_dir: Path, console) -> dict:
    recipe = recipe_variant(path, run=f"repro-{mode}-{label}", seed=seed)
    recipe = recipe.model_copy(update={"dataflow": recipe.dataflow.model_copy(update={"mode": mode})})
    summary = run_one(Path(recipe.source), cfg, DemoOptions(steps=steps, runs_dir=runs_dir, live=False), console,
                      recipe=recipe)
    policy = recipe.policies[0].name
    lines = (runs_dir / summary["run_id"] / "metrics.jsonl").read_text().splitlines()
    steps_seen = trainer_steps(typed_records(json.loads(line) for line in lines if line.strip()), policy)
    row = summary["policies"][policy]
    return {"ok": summary["returncode"] == 0, "heldout_before": row["before"]["accuracy"],
            "heldout_after": (row.get("after") or {}).get("accuracy"),
            "steps": [{k: getattr(s, k) for k in FIGURES} for s in steps_seen]}


def compare(a: dict, b: dict) -> dict:
    pairs = list(zip(a["steps"], b["steps"], strict=False))
    same = [all(x[k] == y[k] for k in FIGURES) for x, y in pairs]
    first_diff = next((i for i, s in enumerate(same) if not s), None)
    return {"steps": len(pairs), "identical_steps": sum(same), "first_different_step": first_diff,
            "first_difference": None if first_diff is None else [pairs[first_diff][0], pairs[first_diff][1]],
            "same_per_figure": {k: sum(x[k] == y[k] for x, y in pairs) for k in FIGURES},
            "heldout_after": [a["heldout_after"], b["heldout_after"]],
            "heldout_before": [a["heldout_before"], b["heldout_before"]],
            "reward_last": [a["steps"][-1]["reward_mean"] if a["steps"] else None,
                            b["steps"][-1]["reward_mean"] if b["steps"] else None]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a recipe name under examples/recipes/ or a path")
    ap.add_argument("--modes", default="sync,async", help="dataflow modes to compare, comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = recipe_path(args.recipe).resolve()

    import torch
    from rich.console import Console

    torch.set_num_threads(1)
    console = Console(stderr=True, width=120)
    t0 = time.monotonic()
    result: dict = {"benchmark": "reproducibility", "recipe": str(path), "seed": args.seed, "steps": args.steps}
    ok = True
    with tempfile.TemporaryDirectory(prefix="af-repro-") as tmp, private_cluster() as cfg:
        for mode in args.modes.split(","):
            runs = [one_run(path, mode, label, args.steps, args.seed, cfg, Path(tmp) / "runs", console)
                    for label in ("a", "b")]
            ok = ok and all(r["ok"] for r in runs)
            result[mode] = compare(*runs)
            print(f"{mode}: {json.dumps(result[mode])}", file=sys.stderr, flush=True)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
