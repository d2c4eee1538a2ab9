"""``astraflow archive``: archive a run's log to Parquet in the bucket (see :mod:`astraflow.archive`).

Runs against any cluster (``--config`` / ``$ASTRAFLOW_CONFIG``) until SIGTERM / SIGINT (then it
reads what is left, flushes and exits 0) or, with ``--idle-exit S``, until nothing came for S seconds.
"""

from __future__ import annotations

import argparse
import json
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "archive", help="archive a run's trajectories, batches, weights and metrics to Parquet in the bucket",
        description="Consume the run's topics in group <run>.archive and write Parquet parts under "
        "<run>/archive/kind=<kind>/policy=<policy>/ (upload, then commit: exactly once across restarts). "
        "While it runs, records every reading group of the run has committed past leave the log "
        "(kafka.retention in the cluster config; docs/running.md, \"Log retention\").")
    p.add_argument("--recipe", default=None, help="recipe YAML (its run id and policies)")
    p.add_argument("--run-id", default=None, help="run id (default: the cluster config's / $ASTRAFLOW_RUN, "
                   "else the recipe's `run`)")
    p.add_argument("--policy", action="append", default=None,
                   help="policy whose batches/weights to archive (repeatable; default: the recipe's)")
    p.add_argument("--max-records", type=int, default=5000, help="flush a partition after this many records")
    p.add_argument("--max-mb", type=float, default=64.0, help="flush a partition after this many MB of rows")
    p.add_argument("--flush-s", type=float, default=10.0, help="flush a partition after this many seconds")
    p.add_argument("--idle-exit", type=float, default=None, metavar="S",
                   help="exit 0 once nothing came for S seconds (default: run until SIGTERM)")
    p.add_argument("--trim-log", action="store_true",
                   help="also trim the run's log (a run without a dataflow, which otherwise does it)")
    p.add_argument("--log-level", default=os.environ.get("ASTRAFLOW_LOG_LEVEL", "INFO"))
    p.set_defaults(func=cmd_archive)


def cmd_archive(args: argparse.Namespace) -> int:
    from astraflow.cli.bucket_cluster import command_cluster
    from astraflow.cli.cluster_args import load_cluster
    from astraflow.cli.components import log_to_stderr
    from astraflow.config import ConfigError

    log_to_stderr(args.log_level)
    cfg = load_cluster(args)
    recipe = None
    if args.recipe:
        from astraflow.recipe import Recipe

        recipe = Recipe.load(args.recipe)
    run = args.run_id or (cfg.run if "run" in cfg.model_fields_set or recipe is None else recipe.run)
    policies = args.policy or ([p.name for p in recipe.policies] if recipe is not None else [])
    if not policies:
        raise ConfigError("astraflow archive: name the policies (--policy NAME, repeatable) or give --recipe")
    with command_cluster(args, run=run) as cfg:
        return _archive(args, cfg, run, recipe, policies)


def _archive(args: argparse.Namespace, cfg, run: str, recipe, policies: list[str]) -> int:
    from astraflow.archive import Archiver
    from astraflow.cli.components import _stop_on_signals
    from astraflow.embedded.vacuum import VolumeVacuum
    from astraflow.log.client_logs import summarise_kafka_logs
    from astraflow.log.retention import LogRetention
    from astraflow.prometheus import serve_prometheus

    summarise_kafka_logs(cfg.kafka.bootstrap or "?")
    stop = _stop_on_signals()
    archiver = Archiver(cfg, policies, max_records=args.max_records, max_bytes=int(args.max_mb * 1024 * 1024),
                        flush_s=args.flush_s)
    prometheus = serve_prometheus(cfg.prometheus, "archive")
    if prometheus is not None:
        prometheus.add_source("archiver", archiver.stats.as_dict)
    # The dataflow trims the log, the archive group one of the readers it waits for; in a run without a
    # dataflow (trainers fed from an archive) the archiver does (the task topics only where the recipe
    # names the pools).
    pools = [p.name for p in recipe.pools] if recipe is not None else []
    retention = LogRetention.for_run(cfg, pools, policies) if args.trim_log else None
    if retention is not None:
        retention.start()
    # The embedded S3 server frees a deleted object's disk only when asked to compact its volumes: the
    # component that trims the log asks (the dataflow, or this archiver with --trim-log).
    vacuum = VolumeVacuum(cfg.s3.embedded_master, filer_url=cfg.s3.embedded_filer).start() if cfg.s3.embedded_master and args.trim_log else None
    try:
        stats = archiver.run(stop, idle_exit_s=args.idle_exit)
    finally:
        if retention is not None:
            retention.stop()
        if vacuum is not None:
            vacuum.stop()
        archiver.close()
    print(json.dumps({"run": run, **stats.as_dict(),
                      **({"log_retention": retention.stats.as_dict()} if retention is not None else {})}))
    return 0
