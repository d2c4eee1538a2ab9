"""``astraflow replay RUN``: an archived run's trajectories through dataflow configurations, offline.

See :mod:`astraflow.archive.replay` for what is replayed and how; docs/archive.md for examples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay", help="replay an archived run through dataflow configurations (no engine, no trainer)",
        description="Feed the trajectories archived under <run>/archive/ (and the weight timeline) through "
        "the dataflow's own staleness rule, filters and batch sampler, once for the run's recipe and once "
        "per --variant, and compare what each keeps and drops.",
        epilog="examples:\n"
        "  astraflow replay math-1a2b --recipe examples/recipes/math.yaml\n"
        "  astraflow replay math-1a2b --recipe examples/recipes/math.yaml \\\n"
        "      --variant dapo='{filters: [dynamic_sampling]}' --variant fresh='{max_staleness: 0}'\n"
        "  astraflow replay math-1a2b --recipe r.yaml --variant mine=my_dataflow.yaml --json\n"
        "to train on what a configuration keeps (no rollouts): astraflow run RECIPE --from-archive RUN",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_id", metavar="RUN", help="the archived run's id")
    p.add_argument("--recipe", required=True,
                   help="the run's recipe YAML: its dataflow section is the baseline configuration")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC",
                   help="another configuration: dataflow fields (YAML file, or inline YAML such as "
                        "'{filters: [dynamic_sampling]}') over the recipe's; repeatable")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="module that registers your own plug-ins (besides the recipe's `imports`)")
    p.add_argument("--plot", default=None, metavar="PNG", help="where to draw the comparison (default replay-RUN.png)")
    p.add_argument("--no-plot", action="store_true", help="draw nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--from-log", action="store_true",
                   help="read the run's topics instead of its archive (a live run, or one run with --no-archive, "
                        "while the log still holds its records; held in memory)")
    p.add_argument("--all-records", action="store_true",
                   help="replay every archived trajectory, also those the online dataflow never read (episodes "
                        "that finished while the run stopped); default: up to its last saved position")
    p.set_defaults(func=cmd_replay)


def parse_variant(text: str, base: Any) -> tuple[str, Any]:
    """``NAME=SPEC`` -> (name, DataflowConfig of the recipe's section updated by SPEC)."""
    import yaml

    from astraflow.config import ConfigError
    from astraflow.dataflow.config import DataflowConfig

    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ConfigError(f"--variant {text!r}: expected NAME=SPEC (a YAML file or inline YAML mapping)")
    path = Path(spec)
    try:
        fields = yaml.safe_load(path.read_text()) if path.is_file() else yaml.safe_load(spec)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--variant {name}: not YAML: {exc}") from None
    if isinstance(fields, dict) and set(fields) == {"dataflow"}:
        fields = fields["dataflow"]  # a recipe-shaped file
    if not isinstance(fields, dict):
        raise ConfigError(f"--variant {name}: expected a mapping of dataflow fields, got {fields!r}")
    try:
        return name, DataflowConfig.model_validate({**base.model_dump(), **fields})
    except ValueError as exc:
        raise ConfigError(f"--variant {name}: {exc}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    import importlib

    from astraflow.archive.replay import ArchivedRun, replay, require_archive
    from astraflow.cli.bucket_cluster import command_cluster, require_run
    from astraflow.config import ConfigError
    from astraflow.objstore import ObjectStore
    from astraflow.objstore.progress import transfer_progress
    from astraflow.recipe import Recipe

    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--import {module}: {exc}") from None
    recipe = Recipe.load(args.recipe)
    configs = [("recipe", recipe.dataflow)] + [parse_variant(v, recipe.dataflow) for v in args.variant]
    names = [n for n, _ in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--variant names must differ (and not be 'recipe'): {names}")
    with command_cluster(args, run=args.run_id) as cfg:
        store = ObjectStore.from_config(cfg)
        if args.from_log:
            from astraflow.archive.live import LiveRun

            archived = LiveRun(store, args.run_id, cfg=cfg, policies=[p.name for p in recipe.policies])
        else:
            require_run(store, args.run_id)
            require_archive(store, cfg, args.run_id)
            archived = ArchivedRun(store, args.run_id)
        if not args.all_records:
            archived.until = archived.dataflow_consumed()
        summaries = []
        for name, section in configs:
            if not args.json:
                print(f"replaying {args.run_id} with {name} ...", file=sys.stderr, flush=True)
            with transfer_progress(store, f"{name}: reading {args.run_id}"):
                summaries.append(replay(name, section, archived.events(), recipe.dataset.samples).summary())
        online = archived.online_counters()
    title = f"replay of {args.run_id}"
    plot = None
    if not args.no_plot:
        from astraflow.report.replay import write_replay_plot

        plot = write_replay_plot(summaries, args.plot or f"replay-{args.run_id}.png", title)
    if args.json:
        print(json.dumps({"run": args.run_id, "configurations": summaries, "online": online,
                          "replayed_until": archived.until,
                          "plot": str(plot) if plot else None}))
        return 0
    from rich.console import Console

    from astraflow.report.replay import replay_table

    console = Console()
    console.print(replay_table(summaries, online, title))
    if plot is not None:
        console.print(f"plot: {plot}")
    return 0
