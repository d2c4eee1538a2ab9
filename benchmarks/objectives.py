"""Does each objective option train? The math recipe (examples/recipes/math.yaml) run once per option of
``backend.objective`` (docs/training.md#objectives), the default GRPO objective as the baseline in the
same invocation, each measured as ``astraflow demo`` measures it (benchmarks/_learning.py): mean batch
reward over the first and the last 5 steps, held-out greedy accuracy of v0 and of the final version,
and for the KL options the KL to the reference over the last 5 steps, at two coefficients.

    python benchmarks/objectives.py                      # every variant, 30 steps each
    python benchmarks/objectives.py --only grpo,kl_k3_loss_0.01 --steps 20

One run per variant and one seed: a variant "trains" when its reward rises; differences between
variants of a few points are within the seed-to-seed spread (benchmarks/seeds.py). Prints one JSON line
last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _learning import ROOT, measured_run, recipe_variant

RECIPE = ROOT / "examples" / "recipes" / "math.yaml"

VARIANTS: dict[str, dict] = {
    "grpo": {},
    "dr_grpo": {"advantage": "dr_grpo", "aggregation": "seq_mean_token_sum", "norm_tokens": 3},
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {"advantage": "reinforce_pp"},
    "seq_mean": {"aggregation": "seq_mean"},
    "entropy_0.01": {"entropy_coef": 0.01},
    "dual_clip_3": {"dual_clip": 3.0},
    "grpo_mb4": {},
    "dual_clip_1.5_mb4": {"dual_clip": 1.5},
    "overlong_3_1": {"overlong": {"max_tokens": 3, "buffer": 1, "penalty": 0.5}},
    "kl_k1_loss_0.05": {"kl": {"coef": 0.05, "estimator": "k1", "mode": "loss"}},
    "kl_k3_reward_0.05": {"kl": {"coef": 0.05, "estimator": "k3", "mode": "reward"}},
    "kl_k3_loss_0.01": {"kl": {"coef": 0.01, "estimator": "k3", "mode": "loss"}},
    "kl_k3_loss_1": {"kl": {"coef": 1.0, "estimator": "k3", "mode": "loss"}},
}
"""Variant name -> ``backend.objective``. The math recipe's responses are at most 3 tokens
(``max_new_tokens: 3``): Dr. GRPO's constant normaliser and the overlong window use that budget."""

BACKEND: dict[str, dict] = {"grpo_mb4": {"minibatches": 4}, "dual_clip_1.5_mb4": {"minibatches": 4}}
"""Other backend options of a variant: the clips act only with several minibatches per batch (with one,
the ratio to the proximal policy is 1 at the update), so dual clip is also run at 4, with its baseline."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="RL steps per variant (default 30)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")

    import tempfile

    import torch
    from rich.console import Console

    from astraflow.testing.runs import private_cluster

    torch.set_num_threads(1)
    console = Console(stderr=True, width=120)
    t0 = time.monotonic()
    out: dict = {"benchmark": "objectives", "recipe": str(RECIPE.relative_to(ROOT)), "steps": args.steps,
                 "variants": {}}
    with tempfile.TemporaryDirectory(prefix="af-objectives-") as tmp, private_cluster() as cfg:
        for name in names:
            recipe = recipe_variant(RECIPE, run=f"obj-{name.replace('_', '-').replace('.', '')}",
                                    objective=VARIANTS[name], backend=BACKEND.get(name))
            row = measured_run(recipe, cfg, Path(tmp) / "runs", args.steps, console)
            row["objective"] = VARIANTS[name]
            row["backend"] = BACKEND.get(name, {})
            out["variants"][name] = row
            print(f"{name}: reward {row['reward_first']} -> {row['reward_last']}, held-out "
                  f"{row['heldout_before']} -> {row['heldout_after']}, kl_ref {row['kl_ref_last']}, entropy "
                  f"{row['entropy_first']} -> {row['entropy_last']} ({row['rl_seconds']} s)", file=sys.stderr, flush=True)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0 if all(r["ok"] for r in out["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
