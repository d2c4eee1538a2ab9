"""``astraflow runs ls | show RUN``: the runs a bucket holds, from its listing and Parquet footers;
``astraflow runs rollback RUN STEP``: make a kept checkpoint of a run its latest."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("runs", help="list the runs in the bucket, or show one",
                              description="What the cluster's bucket holds per run (weights, checkpoints, "
                              "dataflow state, claim checks, archive).")
    sub = p.add_subparsers(dest="runs_command", metavar="ls|show|rollback", required=True)
    ls = sub.add_parser("ls", help="one line per run: objects, size, policies, latest versions, checkpointed "
                        "steps, archived parts")
    ls.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="one run: size per area, versions per policy, archived rows per kind")
    show.add_argument("run_id", metavar="RUN")
    show.add_argument("--json", action="store_true", help="one JSON document instead of the tables")
    show.set_defaults(func=cmd_show)
    rollback = sub.add_parser(
        "rollback", help="make every policy's kept checkpoint of STEP its latest (stop the run's trainers first: "
        "their next start resumes from it and trains the batches after it again); `astraflow run --run-id RUN "
        "--from-checkpoint STEP` does this before it starts the run")
    rollback.add_argument("run_id", metavar="RUN")
    rollback.add_argument("step", type=int, metavar="STEP", help="a kept checkpoint's step (`astraflow runs show RUN`)")
    rollback.set_defaults(func=cmd_rollback)


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator:
    from astraflow.cli.bucket_cluster import command_cluster
    from astraflow.objstore import ObjectStore

    with command_cluster(args) as cfg:
        yield ObjectStore.from_config(cfg)


def cmd_ls(args: argparse.Namespace) -> int:
    from astraflow.objstore.runs import checkpointed_steps, list_runs

    with _store(args) as store:
        summaries = list_runs(store)
        steps = {s.run: checkpointed_steps(store, s) for s in summaries}
    if not summaries:
        print(f"astraflow runs ls: s3://{store.bucket}/ holds no run yet (train one with `astraflow run RECIPE`)",
              file=sys.stderr)
        return 1
    if args.json:
        for s in summaries:
            print(json.dumps({**s.as_row(), "checkpointed_step": steps[s.run]}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(summaries)} run(s)")
    for col in ("run", "objects", "MB", "policies (latest version)", "checkpointed step", "archived parts",
                "last write"):
        table.add_column(col, justify="right" if col in ("objects", "MB") else "left")
    for s in summaries:
        row = s.as_row()
        table.add_row(s.run, str(row["objects"]), f"{row['mb']:.1f}",
                      ", ".join(f"{p} (v{v})" for p, v in row["latest_version"].items()) or "-",
                      ", ".join(f"{p} {n}" for p, n in steps[s.run].items()) or "-",
                      ", ".join(f"{k} {n}" for k, n in row["archived_parts"].items()) or "-",
                      row["last_modified"] or "-")
    Console().print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from astraflow.cli.bucket_cluster import require_run
    from astraflow.objstore.runs import archived_rows, checkpointed_steps, list_runs

    with _store(args) as store:
        require_run(store, args.run_id)
        s = list_runs(store, args.run_id)[0]
        rows = archived_rows(store, s)
        doc = {**s.as_row(), "bytes_by_area": dict(s.area_bytes),
               "versions": {p: {"count": len(v), "first": v[0], "last": v[-1]} for p, v in s.versions.items() if v},
               "archived_rows": rows, "checkpointed_step": checkpointed_steps(store, s),
               "kept_checkpoints": dict(s.kept_checkpoints)}
    if args.json:
        print(json.dumps(doc))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{s.run}[/]: {s.objects} objects, {s.bytes / 1e6:.1f} MB, last write {doc['last_modified']}")
    areas = Table(title="bytes by area")
    areas.add_column("area")
    areas.add_column("MB", justify="right")
    for area, n in sorted(s.area_bytes.items()):
        areas.add_row(area, f"{n / 1e6:.2f}")
    console.print(areas)
    versions = Table(title="weight versions and trainer checkpoints")
    for col in ("policy", "versions", "first", "last", "checkpointed step", "kept checkpoints (--from-checkpoint)"):
        versions.add_column(col)
    for p, v in doc["versions"].items():
        versions.add_row(p, str(v["count"]), str(v["first"]), str(v["last"]),
                         str(doc["checkpointed_step"].get(p, "-")),
                         " ".join(map(str, doc["kept_checkpoints"].get(p, []))) or "-")
    console.print(versions)
    archive = Table(title="archive (rows from the Parquet footers)")
    archive.add_column("kind")
    archive.add_column("parts", justify="right")
    archive.add_column("rows", justify="right")
    for kind, n in rows.items():
        archive.add_row(kind, str(len(s.archive_parts[kind])), str(n))
    console.print(archive if rows else "archive: none (run with --no-archive, or not archived yet)")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from astraflow.cli.bucket_cluster import command_cluster, require_run
    from astraflow.launcher.rollback import roll_back
    from astraflow.objstore import ObjectStore
    from astraflow.objstore.runs import list_runs
    from astraflow.trainer.checkpoint import CheckpointError

    with command_cluster(args, run=args.run_id) as cfg:
        store = ObjectStore.from_config(cfg)
        require_run(store, args.run_id)
        policies = sorted(list_runs(store, args.run_id)[0].checkpoint_pointers)
        if not policies:
            print(f"astraflow runs rollback: run {args.run_id} has no trainer checkpoint", file=sys.stderr)
            return 1
        try:
            roll_back(cfg, policies, args.step, print)
        except CheckpointError as exc:
            print(f"astraflow runs rollback: {exc}", file=sys.stderr)
            return 1
    return 0
