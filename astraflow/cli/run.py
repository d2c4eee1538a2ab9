"""``astraflow run RECIPE`` and ``astraflow demo``."""

from __future__ import annotations

import argparse
from pathlib import Path

from astraflow.cli.cluster_args import load_cluster


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a recipe: dataflow, trainers and RaaS nodes as processes, with live progress",
        description=(
            "Start the embedded stack if no Kafka/S3 is configured and none runs, create the run's "
            "topics, launch the dataflow, one trainer per policy and the RaaS nodes of every pool as "
            "separate processes (logs in runs/<run>/logs/), follow <run>.metrics, and stop everything "
            "when every trainer is done or on Ctrl+C. Writes runs/<run>/metrics.jsonl and report.png."
        ),
    )
    run.add_argument("recipe", type=Path, help="recipe YAML (see examples/recipes/)")
    run.add_argument("--run-id", help="run id (default: <recipe run>-<timestamp>, a fresh run; "
                     "an existing id resumes that run from its checkpoints)")
    run.add_argument("--nodes", action="append", default=[], metavar="POOL=N",
                     help="RaaS nodes to start for POOL (repeatable; default: the recipe's)")
    run.add_argument("--steps", type=int, help="trainer steps per policy (default: the recipe's)")
    run.add_argument("--state-dir", type=Path, help="embedded stack state dir (default: the cluster "
                     "config's, i.e. $ASTRAFLOW_STATE_DIR or ./.astraflow)")
    run.add_argument("--log-storage", choices=["s3", "memory"], default=None,
                     help="log storage of an embedded stack started for the run: 's3' = durable, kept in "
                     "the state dir (a stopped run resumes with its records); 'memory' = lost when the "
                     "run ends (default: $ASTRAFLOW_LOG_STORAGE, else s3)")
    run.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where runs/<run> goes (default: %(default)s)")
    run.add_argument("--timeout", type=float, help="stop with an error if the run is not done after this many seconds")
    run.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL at stop "
                     "(default: %(default)s)")
    run.add_argument("--max-restarts", type=int, default=5, metavar="N",
                     help="restarts allowed per component within 10 minutes (backoff 1 s doubling to "
                     "30 s); one more death fails the run; 0 never restarts (default: %(default)s)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="torch threads per component process (default: the cores this process may use, "
                     "divided among the trainers and nodes, at least 1)")
    run.add_argument("--no-live", action="store_true", help="print progress lines instead of a live table")
    run.add_argument("--prometheus", action="store_true",
                     help="every component serves Prometheus /metrics on a free loopback port; the targets "
                     "in runs/<run>/prometheus.json (file_sd format); needs the prometheus extra")
    run.add_argument("--no-archive", action="store_true",
                     help="do not start the archiver (Parquet of the run's log under <run>/archive/)")
    run.add_argument("--from-archive", metavar="RUN",
                     help="train from an archived run instead of rolling out: the batches the recipe's dataflow "
                     "section serves from RUN's archive (as `astraflow replay` judges them) go to this run's "
                     "trainers; no dataflow, no RaaS node (off-policy: docs/archive.md)")
    run.add_argument("--from-checkpoint", type=int, metavar="STEP",
                     help="with --run-id: restart that run from every policy's kept checkpoint of step STEP "
                     "(trainer.keep_checkpoints keeps the newest ones; the trainer trains the batches after STEP "
                     "again, which the log keeps for it): docs/running.md")
    run.set_defaults(func=cmd_run)

    demo = subparsers.add_parser(
        "demo",
        help="SFT warm start, then distributed RL; held-out accuracy before and after",
        description=(
            "For each demo recipe: build the tiny model(s), supervised warm start, greedy held-out "
            "evaluation, publish the warm-started weights as version 0, run the recipe with the "
            "launcher (separate processes, real broker and bucket), pull the final weights and "
            "evaluate again. Prints a summary table and writes runs/<run>/summary.json."
        ),
    )
    demo.add_argument("--recipes", default="math,solver_verifier,calc_agent",
                      help="comma-separated names in examples/recipes/ or paths (default: %(default)s)")
    demo.add_argument("--quick", action="store_true", help="fewer RL steps and eval prompts (a smoke run)")
    demo.add_argument("--steps", type=int, help="override the RL steps of every recipe")
    demo.add_argument("--state-dir", type=Path, help="embedded stack state dir")
    demo.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where runs/<run> goes (default: %(default)s)")
    demo.add_argument("--no-live", action="store_true", help="print progress lines instead of a live table")
    demo.set_defaults(func=cmd_demo)


def parse_nodes(items: list[str]) -> dict[str, int]:
    from astraflow.config import ConfigError

    out = {}
    for item in items:
        pool, sep, n = item.partition("=")
        if not sep or not pool or not n.isdigit():
            raise ConfigError(f"--nodes expects POOL=N (e.g. default=2), got {item!r}")
        out[pool] = int(n)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    """Ctrl+C / SIGTERM at any moment: one line, exit status 130, nothing left running (the
    launcher stops its components, ``open_cluster`` the embedded stack it started)."""
    from rich.console import Console
    from rich.markup import escape

    from astraflow.launcher import RunOptions, launch
    from astraflow.launcher.cluster import open_run_cluster
    from astraflow.launcher.interrupts import interrupt_guard, signal_name
    from astraflow.launcher.plan import refuse_unavailable_devices
    from astraflow.launcher.restarts import RestartPolicy
    from astraflow.recipe import Recipe

    console = Console()
    with interrupt_guard():
        try:
            if args.from_checkpoint is not None and not args.run_id:
                raise ValueError("--from-checkpoint needs --run-id: the run whose checkpoint to restart from")
            recipe = Recipe.load(args.recipe)
            refuse_unavailable_devices(recipe, str(args.recipe))  # before an embedded stack starts for nothing
            opts = RunOptions(run_id=args.run_id, steps=args.steps, nodes=parse_nodes(args.nodes),
                              runs_dir=args.runs_dir, grace_s=args.grace, timeout_s=args.timeout,
                              live=False if args.no_live else None, archive=not args.no_archive,
                              from_archive=args.from_archive, from_checkpoint=args.from_checkpoint,
                              threads=args.threads, prometheus=args.prometheus,
                              restart=RestartPolicy(max_restarts=args.max_restarts))
            with open_run_cluster(load_cluster(args), log_storage=args.log_storage,
                                  announce=lambda m: console.print(m, highlight=False)) as cluster:
                opts.stack = cluster.stack  # started for this run: its servers are restarted too
                result = launch(recipe, cluster.cfg, opts, console)
        except KeyboardInterrupt as exc:
            console.print(f"astraflow run: interrupted ({signal_name(exc)}); nothing left running",
                          highlight=False)
            return 130
        except (RuntimeError, ValueError) as exc:
            # One line on stderr, however long (a path, a port list): rich would wrap it at the width.
            Console(stderr=True).print(f"[red]astraflow run failed:[/red] {escape(str(exc))}", highlight=False,
                                       soft_wrap=True)
            return 1
    return result.returncode


def cmd_demo(args: argparse.Namespace) -> int:
    from astraflow.demo import DemoOptions, run_demo

    opts = DemoOptions(recipes=[r.strip() for r in args.recipes.split(",") if r.strip()], quick=args.quick,
                       steps=args.steps, runs_dir=args.runs_dir, live=False if args.no_live else None)
    return run_demo(load_cluster(args), opts)
