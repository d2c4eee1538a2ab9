"""Does a recipe learn whatever the seed? ``benchmarks/seeds.py RECIPE --seeds N`` runs the recipe N times
with seeds 0 .. N-1 (the recipe's seed and each policy's SFT seed; the dataset's seed is kept, so every
run is evaluated on the same held-out prompts), each measured as ``astraflow demo`` measures it
(benchmarks/_learning.py: held-out greedy accuracy of the warm start v0 and of the final version,
from the weight store), and reports per seed and policy the accuracy before and after RL, then the
mean, the median, the min and max and the population std of the after figures and of the gains, and
how many seeds learned (after > before). Writes a PNG (each seed's before -> after, per policy) and
prints one JSON line last.

    python benchmarks/seeds.py math --seeds 5                # examples/recipes/math.yaml
    python benchmarks/seeds.py examples/recipes/solver_verifier.yaml --seeds 3 --steps 40

A sweep of a demo recipe at its full length takes minutes per seed on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _learning import measured_run, recipe_variant

from astraflow.demo import recipe_path


def spread(values: list[float]) -> dict[str, float]:
    """Mean, median, min, max and population std of ``values``."""
    return {"mean": round(statistics.fmean(values), 4), "median": round(statistics.median(values), 4),
            "min": round(min(values), 4), "max": round(max(values), 4), "std": round(statistics.pstdev(values), 4)}


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Each seed's held-out accuracy before -> after RL, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(rows[0]["heldout"])
    fig, axes = plt.subplots(1, len(policies), figsize=(4.5 * len(policies), 4), squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=True):
        for row in rows:
            h = row["heldout"][policy]
            if h["after"] is None:
                continue
            ax.plot([0, 1], [h["before"], h["after"]], marker="o", label=f"seed {row['seed']}")
        ax.set_xticks([0, 1], ["before RL (v0)", "after RL"])
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.set_title(policy)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a recipe name under examples/recipes/ or a path")
    ap.add_argument("--seeds", type=int, default=5, help="runs, with seeds 0 .. N-1 (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="where to write the PNG (default runs/seeds-<recipe>-<time>.png)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + N - 1 (default 0)")
    ap.add_argument("--backend", type=json.loads, default=None,
                    help='JSON of backend options for every policy, e.g. \'{"lr": 5e-4}\'')
    ap.add_argument("--objective", type=json.loads, default=None,
                    help='JSON of every policy\'s backend.objective, e.g. \'{"entropy_coef": 0.01}\'')
    ap.add_argument("--dataflow", type=json.loads, default=None,
                    help='JSON of dataflow options, e.g. \'{"filters": [{"type": "dynamic_sampling"}]}\'')
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                    help="set any recipe field by its dotted path, VALUE read as YAML (repeatable), e.g. "
                         "--set dataset.samples=16 --set sampling.policy.temperature=1.2")
    ap.add_argument("--runs-dir", type=Path, default=None,
                    help="keep each run's runs/<run> (metrics.jsonl, report.png) here (default: a temporary dir)")
    args = ap.parse_args(argv)
    path = recipe_path(args.recipe).resolve()

    import tempfile

    import torch
    from rich.console import Console

    from astraflow.config import ConfigError
    from astraflow.testing.runs import private_cluster

    try:  # every variant before any run: a misspelt --set is one line, not a traceback after a stack start
        variants = {seed: recipe_variant(path, run=f"seeds-{path.stem.replace('_', '-')}-s{seed}", seed=seed,
                                         objective=args.objective, backend=args.backend, dataflow=args.dataflow,
                                         overrides=dict(o.split("=", 1) for o in args.overrides))
                    for seed in range(args.first_seed, args.first_seed + args.seeds)}
    except ConfigError as exc:
        print(f"seeds.py: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    console = Console(stderr=True, width=120)
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="af-seeds-") as tmp, private_cluster() as cfg:
        for seed, recipe in variants.items():
            runs_dir = args.runs_dir or Path(tmp) / "runs"
            row = {"seed": seed, **measured_run(recipe, cfg, runs_dir, args.steps, console)}
            rows.append(row)
            print(f"seed {seed}: " + ", ".join(f"{p} {h['before']} -> {h['after']}" for p, h in row["heldout"].items())
                  + f" ({row['rl_seconds']} s RL)", file=sys.stderr, flush=True)
    summary = {}
    for policy in rows[0]["heldout"]:
        done = [r["heldout"][policy] for r in rows if r["ok"] and r["heldout"][policy]["after"] is not None]
        if not done:
            summary[policy] = {"runs": 0}
            continue
        summary[policy] = {"runs": len(done), "learned": sum(h["after"] > h["before"] for h in done),
                           "before": spread([h["before"] for h in done]), "after": spread([h["after"] for h in done]),
                           "gain": spread([h["after"] - h["before"] for h in done])}
    out_png = args.plot or Path("runs") / f"seeds-{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}.png"
    out_png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, f"{path.name}: {args.seeds} seeds, {rows[0]['steps']} steps", out_png)
    result = {"benchmark": "seeds", "recipe": str(path), "seeds": args.seeds, "first_seed": args.first_seed,
              "steps": args.steps, "backend": args.backend, "objective": args.objective,
              "dataflow": args.dataflow, "overrides": args.overrides,
              "per_seed": [{k: r[k] for k in ("seed", "ok", "steps", "heldout", "reward_first", "reward_last",
                                              "rl_seconds")} for r in rows],
              "summary": summary, "plot": str(out_png), "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
