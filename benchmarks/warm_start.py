"""Where does a recipe's warm start leave each seed? ``benchmarks/warm_start.py RECIPE --seeds N`` runs only
the supervised warm start of the recipe's first policy, seeds 0 .. N-1, and measures the held-out accuracy
(greedy) of the weights RL would start from, as ``benchmarks/seeds.py`` measures its "before" figure: the
same seeds, the same held-out prompts, the weights cast to ``trainer.publish_dtype``, one torch thread. No
broker, bucket or RL: seconds per seed for the math recipe, so a warm start's settings can be compared
over many seeds before a sweep of whole runs. Prints one JSON line last.

    python benchmarks/warm_start.py math --seeds 5 --set policies.0.sft.lr=1e-3
    python benchmarks/warm_start.py calc_agent --seeds 2 --set policies.0.sft.steps=600
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _learning import recipe_variant
from seeds import spread

from astraflow.demo import recipe_path


def warm_start_figures(recipe) -> dict:
    """The warm start of ``recipe``'s first policy, as ``astraflow demo`` runs it, and its held-out figures."""
    import torch

    from astraflow.demo import evaluate
    from astraflow.models import load_policy_model, load_policy_tokenizer
    from astraflow.recipe.data import recipe_dataset, task_of
    from astraflow.sft import warm_start
    from astraflow.trainer.service import publishable

    policy = recipe.policies[0].name
    dataset = recipe_dataset(recipe)
    heldout = [task_of(p, recipe) for p in dataset.problems("heldout", recipe.eval.prompts)]
    torch.manual_seed(recipe.seed)
    model = load_policy_model(recipe, policy)
    figures = warm_start(model, load_policy_tokenizer(recipe, policy), recipe, policy, dataset=dataset,
                         progress=False)
    held = evaluate(recipe, policy, publishable(model.state_dict(), recipe.trainer.publish_dtype), 0, heldout)
    return {"policy": policy, "heldout": held["accuracy"], "n": held["n"],
            "sft_final_loss": round(figures["sft_final_loss"], 4), "sft_seconds": round(figures["sft_seconds"], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a recipe name under examples/recipes/ or a path")
    ap.add_argument("--seeds", type=int, default=5, help="warm starts, with seeds first-seed .. first-seed + N - 1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                    help="set any recipe field by its dotted path, VALUE read as YAML (repeatable), e.g. "
                         "--set policies.0.sft.lr=1e-3")
    args = ap.parse_args(argv)
    path = recipe_path(args.recipe).resolve()

    import torch

    from astraflow.config import ConfigError

    try:  # every variant before any warm start: a misspelt --set is one line, not a traceback
        variants = {seed: recipe_variant(path, run=f"warm-start-s{seed}", seed=seed,
                                         overrides=dict(o.split("=", 1) for o in args.overrides))
                    for seed in range(args.first_seed, args.first_seed + args.seeds)}
    except ConfigError as exc:
        print(f"warm_start.py: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as benchmarks/seeds.py, so that its "before" figures are these
    t0 = time.monotonic()
    rows = []
    for seed, recipe in variants.items():
        rows.append({"seed": seed, **warm_start_figures(recipe)})
        print(f"seed {seed}: held-out {rows[-1]['heldout']} (SFT loss {rows[-1]['sft_final_loss']}, "
              f"{rows[-1]['sft_seconds']} s)", file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "warm_start", "recipe": str(path), "seeds": args.seeds,
                      "first_seed": args.first_seed, "overrides": args.overrides, "per_seed": rows,
                      "heldout": spread([r["heldout"] for r in rows]), "wall_s": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
