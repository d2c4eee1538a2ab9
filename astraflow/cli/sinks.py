"""``astraflow sinks``: feed the recipe's ``report`` sinks (TensorBoard, MLflow, W&B) from ``<run>.metrics``.

``astraflow run`` starts it when the recipe sets a sink; run it by hand to watch a run from another
machine against the same cluster (``--config``). Runs until SIGTERM / SIGINT (then reads what is left
and exits 0) or, with ``--idle-exit S``, until nothing came for S seconds.
"""

from __future__ import annotations

import argparse
import json
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sinks", help="write a run's metrics to the recipe's report sinks (TensorBoard, MLflow, W&B)",
        description="Consume <run>.metrics in group <run>.sinks from its start and write the scalars of each "
        "trainer step and the nodes' tokens/s per pool to the sinks of the recipe's `report` section.")
    p.add_argument("--recipe", required=True, help="recipe YAML (its `report` section and run id)")
    p.add_argument("--run-id", default=None, help="run id (default: the cluster config's / $ASTRAFLOW_RUN, "
                   "else the recipe's `run`)")
    p.add_argument("--idle-exit", type=float, default=None, metavar="S",
                   help="exit 0 once nothing came for S seconds (default: run until SIGTERM)")
    p.add_argument("--log-level", default=os.environ.get("ASTRAFLOW_LOG_LEVEL", "INFO"))
    p.set_defaults(func=cmd_sinks)


def cmd_sinks(args: argparse.Namespace) -> int:
    from astraflow.cli.bucket_cluster import command_cluster
    from astraflow.cli.cluster_args import load_cluster
    from astraflow.cli.components import _stop_on_signals, log_to_stderr
    from astraflow.config import ConfigError
    from astraflow.prometheus import serve_prometheus
    from astraflow.recipe import Recipe
    from astraflow.report.sinks.consumer import SinkStats, run_sinks

    log_to_stderr(args.log_level)
    recipe = Recipe.load(args.recipe)
    if not recipe.report.any:
        raise ConfigError(f"recipe {args.recipe} sets no sink (report: {{tensorboard: {{dir: ...}}}})")
    cfg = load_cluster(args)
    run = args.run_id or (cfg.run if "run" in cfg.model_fields_set else recipe.run)
    stats = SinkStats()
    with command_cluster(args, run=run) as resolved:
        prometheus = serve_prometheus(resolved.prometheus, "sinks")
        if prometheus is not None:
            prometheus.add_source("sinks", stats.as_dict)
        run_sinks(resolved, recipe.report, _stop_on_signals(), idle_exit_s=args.idle_exit, stats=stats)
    print(json.dumps({"run": run, **stats.as_dict()}))
    return 0
