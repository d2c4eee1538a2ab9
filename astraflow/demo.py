"""``astraflow demo``: a tiny model learns with distributed RL on this machine, measured honestly.

For each demo recipe: load each policy's checkpoint (the demo's tiny model is materialised once as a
real checkpoint directory with its own BPE tokenizer and chat template, the path a user's checkpoint
takes), supervised warm start, publish the warm-started weights (cast to ``trainer.publish_dtype``, as the
trainer publishes) as version 0 of each policy (the trainers and nodes bootstrap from the weight
store), evaluate held-out accuracy on exactly those stored weights (greedy), run the recipe with
the launcher (dataflow, trainers and RaaS nodes as separate processes on the real broker and
bucket), pull each policy's final version from the weight store and evaluate again on the same
held-out prompts. Every figure printed is measured in this run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import ClusterConfig
from astraflow.recipe import Recipe

QUICK_STEPS = 6
QUICK_EVAL_PROMPTS = 60


@dataclass
class DemoOptions:
    recipes: list[str] = field(default_factory=lambda: ["math", "solver_verifier", "calc_agent"])
    """Recipe names under examples/recipes/, or paths."""
    quick: bool = False
    """A smoke run: QUICK_STEPS RL steps and QUICK_EVAL_PROMPTS eval prompts (no learning claim)."""
    steps: int | None = None
    """Override the RL steps of every recipe."""
    runs_dir: Path = Path("runs")
    live: bool | None = None


def recipe_path(name: str) -> Path:
    """A path as given, else ``examples/recipes/<name>.yaml`` in the working dir or the source tree."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        cand = root / "examples" / "recipes" / f"{name}.yaml"
        if cand.exists():
            return cand
    raise FileNotFoundError(f"demo recipe {name!r} not found (looked for examples/recipes/{name}.yaml)")


def evaluate(recipe: Recipe, policy: str, state: dict, version: int, tasks: list) -> dict[str, Any]:
    """Greedy held-out figures of ``state`` through the recipe's workflow (answer accuracy,
    balanced verdict accuracy, or whole tool-using episodes: the workflow decides)."""
    import asyncio

    from astraflow.engines import FullState
    from astraflow.raas.setup import build_policy_clients, build_recipe_workflow

    client = build_policy_clients(recipe, recipe.pool(recipe.dataset.pool), "demo-eval", [policy])[policy]
    client.engine.update_weights(FullState(state, version))
    return asyncio.run(build_recipe_workflow(recipe).evaluate(policy, client, tasks))


def pull_version(cfg: ClusterConfig, policy: str, version: int | None) -> tuple[dict, int]:
    """A policy's weights from the weight store (``None``: the latest version)."""
    from astraflow.delta.subscriber import WeightSubscriber

    sub = WeightSubscriber(cfg, policy, "demo-eval", register=False)
    try:
        state, got, _ = sub.pull(version)
        return {k: v.clone() for k, v in state.items()}, got
    finally:
        sub.close(unregister=False)


def warm_start_and_publish(recipe: Recipe, cfg: ClusterConfig, dataset, console,
                           heldout: list) -> dict[str, dict[str, Any]]:
    """Evaluate each policy's checkpoint as loaded (``untrained``), SFT it, publish it as version 0.
    Returns the SFT figures and the untrained evaluation per policy. (The trainers then bootstrap
    from v0 in the store, so they do not warm-start again.)"""
    import torch

    from astraflow.delta.publisher import WeightPublisher
    from astraflow.models import load_policy_model, load_policy_tokenizer
    from astraflow.sft import warm_start
    from astraflow.trainer.service import publishable

    out = {}
    for policy in recipe.policies:
        torch.manual_seed(recipe.seed)
        model = load_policy_model(recipe, policy.name)
        tokenizer = load_policy_tokenizer(recipe, policy.name)
        untrained = evaluate(recipe, policy.name, model.state_dict(), 0, heldout)
        figures = warm_start(model, tokenizer, recipe, policy.name, dataset=dataset)
        figures["untrained"] = untrained
        with WeightPublisher(cfg, policy.name, anchor_every=recipe.trainer.anchor_every) as pub:
            # In the dtype the trainer publishes, so v0 -> v1 is a sparse delta, not a dtype change.
            pub.publish(publishable(model.state_dict(), recipe.trainer.publish_dtype), 0)
            pub.flush()
        console.print(f"  {policy.name}: warm start published as v0 ({figures['sft_seconds']:.1f} s SFT, "
                      f"final loss {figures['sft_final_loss']:.3f})", highlight=False)
        out[policy.name] = figures
    return out


def run_one(path: Path, cfg: ClusterConfig, opts: DemoOptions, console, recipe: Recipe | None = None) -> dict[str, Any]:
    """Warm start, held-out before, the RL run, held-out after, for the recipe at ``path`` (or
    ``recipe``, a variant of it built in memory: benchmarks/seeds.py, benchmarks/objectives.py)."""
    from astraflow.launcher import RunOptions, launch
    from astraflow.launcher.runner import default_run_id
    from astraflow.recipe.data import recipe_dataset, task_of

    t0 = time.monotonic()
    recipe = Recipe.load(path) if recipe is None else recipe
    steps = opts.steps or (QUICK_STEPS if opts.quick else recipe.trainer.steps)
    n_eval = min(recipe.eval.prompts, QUICK_EVAL_PROMPTS) if opts.quick else recipe.eval.prompts
    run_id = default_run_id(recipe)
    run_cfg = cfg.model_copy(update={"run": run_id})
    console.rule(f"[bold]{recipe.run}[/bold]: {', '.join(p.name for p in recipe.policies)} — run {run_id}")
    # The same seeded dataset the dataflow emits its tasks from (astraflow.recipe.data).
    dataset = recipe_dataset(recipe)
    heldout = [task_of(p, recipe) for p in dataset.problems("heldout", n_eval)]

    sft = warm_start_and_publish(recipe, run_cfg, dataset, console, heldout)
    before = {}
    for p in recipe.policies:
        state, v = pull_version(run_cfg, p.name, 0)
        before[p.name] = evaluate(recipe, p.name, state, v, heldout)
        console.print(f"  {p.name}: held-out accuracy before RL {before[p.name]['accuracy']:.3f} "
                      f"(n={before[p.name]['n']}, weights v{v} from the store)", highlight=False)

    t_rl = time.monotonic()
    result = launch(recipe, cfg, RunOptions(run_id=run_id, steps=steps, runs_dir=opts.runs_dir, live=opts.live),
                    console)
    rl_s = time.monotonic() - t_rl
    summary: dict[str, Any] = {"recipe": recipe.run, "recipe_file": str(path), "run_id": run_id,
                               "returncode": result.returncode, "reason": result.reason, "steps": steps,
                               "rl_seconds": round(rl_s, 1), "policies": {}}
    for p in recipe.policies:
        figures = dict(sft[p.name])
        row: dict[str, Any] = {"role": recipe.role(p.name), "untrained": figures.pop("untrained"),
                               "sft": figures, "before": before[p.name]}
        last = result.done.get(p.name) or result.trainers.get(p.name)
        row["trainer_steps"] = last.step if last is not None else None
        if result.returncode == 0:
            state, v = pull_version(run_cfg, p.name, None)
            row["after"] = evaluate(recipe, p.name, state, v, heldout)
            row["final_version"] = v
            row["delta"] = row["after"]["accuracy"] - row["before"]["accuracy"]
        summary["policies"][p.name] = row
    summary["wall_seconds"] = round(time.monotonic() - t0, 1)
    summary_path = result.run_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    summary["summary_path"] = str(summary_path)
    summary["report_path"] = str(result.report_path) if result.report_path else None
    return summary


def _valid_calls(row: dict[str, Any]) -> str:
    """"untrained / before RL / after RL" share of well-formed tool calls, for tool-using policies
    ("-" otherwise)."""
    stages = (row.get("untrained") or {}, row["before"], row.get("after") or {})
    if row["before"].get("valid_call_rate") is None:
        return "-"
    return " / ".join(f"{s['valid_call_rate']:.2f}" if s.get("valid_call_rate") is not None else "n/a"
                      for s in stages)


def print_summary(summaries: list[dict[str, Any]], total_s: float, console) -> None:
    from rich.table import Table

    table = Table(title=f"astraflow demo: held-out accuracy (greedy) of the checkpoint as loaded, after the "
                        f"warm start (before RL) and after RL; total {total_s:.0f} s")
    for col in ("recipe", "policy", "eval n", "untrained", "before RL", "after RL", "delta", "valid calls u/b/a",
                "steps", "wall"):
        table.add_column(col, justify="right" if col not in ("recipe", "policy") else "left",
                         no_wrap=True, min_width=len(col))
    for s in summaries:
        for name, row in s["policies"].items():
            after = row.get("after")
            delta = row.get("delta")
            colour = "green" if delta is not None and delta > 0 else "red"
            table.add_row(
                s["recipe"], name, str(row["before"]["n"]),
                f"{row['untrained']['accuracy']:.3f}" if row.get("untrained") else "-",
                f"{row['before']['accuracy']:.3f}",
                f"{after['accuracy']:.3f}" if after else "[red]n/a[/red]",
                f"[{colour}]{delta:+.3f}[/{colour}]" if delta is not None else "[red]run failed[/red]",
                _valid_calls(row),
                str(row.get("trainer_steps") or "-"),
                f"{s['wall_seconds']:.0f} s",
            )
    console.print(table)
    for s in summaries:
        console.print(f"{s['recipe']}: summary {s.get('summary_path')}, report {s.get('report_path')}",
                      highlight=False)


def run_demo(cfg: ClusterConfig, opts: DemoOptions) -> int:
    """Run every demo recipe; 0 when all ran to completion, 1 otherwise."""
    import torch
    from rich.console import Console

    from astraflow.launcher import open_cluster

    console = Console() if Console().is_terminal else Console(width=120)  # the table must not wrap in logs
    try:
        paths = [recipe_path(r) for r in opts.recipes]
    except FileNotFoundError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.monotonic()
    summaries = []
    failed = []
    try:
        with open_cluster(cfg, announce=lambda m: console.print(m, highlight=False)) as resolved:
            for path in paths:
                s = run_one(path, resolved, opts, console)
                summaries.append(s)
                if s["returncode"] != 0:
                    failed.append(f"{s['recipe']}: {s['reason'].splitlines()[0]}")
                    if s["returncode"] == 130:
                        break
    except KeyboardInterrupt:
        failed.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - report why the demo could not run, then exit non-zero
        console.print(f"[red]astraflow demo could not run:[/red] {type(exc).__name__}: {exc}", highlight=False)
        failed.append(str(exc))
    total = time.monotonic() - t0
    if summaries:
        print_summary(summaries, total, console)
    if failed:
        console.print("[red]demo did not complete:[/red] " + "; ".join(failed), highlight=False)
        return 1
    not_learned = [f"{s['recipe']}/{n}" for s in summaries for n, r in s["policies"].items()
                   if (r.get("delta") or 0) <= 0]
    if not_learned and not opts.quick:
        console.print(f"[yellow]no held-out improvement for {', '.join(not_learned)}[/yellow]")
    return 0
