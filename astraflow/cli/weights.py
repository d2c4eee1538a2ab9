"""``astraflow weights ls | show | verify | gc | export``: inspect and maintain a policy's stored versions,
and take one away as a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from astraflow.cli.bucket_cluster import command_cluster, require_policy


def register(subparsers: argparse._SubParsersAction) -> None:
    weights = subparsers.add_parser(
        "weights",
        help="list, inspect, verify and garbage-collect a policy's weight versions in the bucket",
        description="Versions live in the bucket under <run>/weights/<policy>/: an anchor (full "
        "safetensors) every K versions, one sparse delta per version, a manifest per version.",
    )
    sub = weights.add_subparsers(dest="weights_command", metavar="ACTION", required=True)

    ls = sub.add_parser("ls", help="versions with kind, bytes, sparsity")
    _common(ls)
    ls.set_defaults(func=cmd_ls)

    show = sub.add_parser("show", help="one version's manifest")
    _common(show)
    show.add_argument("version", type=int, nargs="?", help="version (default: latest)")
    show.add_argument("--json", action="store_true", help="print the raw manifest JSON")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", help="recompute checksums along the anchor + delta chain")
    _common(verify)
    verify.add_argument("--from", dest="from_version", type=int, help="start at the first anchor >= this version")
    verify.set_defaults(func=cmd_verify)

    gc = sub.add_parser(
        "gc",
        help="delete old versions (never the latest anchor, its chain, or a live subscriber's chain)",
        description="Keeps the latest anchor and every version after it, the --keep-versions most "
        "recent versions, and for every live subscriber (heartbeat younger than --subscriber-ttl) "
        "the versions after the one it holds. Deletes the rest (manifest first), leftovers of "
        "unpublished versions below the latest, and expired subscriber records.",
    )
    _common(gc)
    gc.add_argument("--keep-versions", type=int, default=2, help="most recent versions always kept (default: %(default)s)")
    gc.add_argument("--subscriber-ttl", type=float, default=600.0, help="seconds a subscriber heartbeat counts as live (default: %(default)s)")
    gc.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    gc.set_defaults(func=cmd_gc)

    export = sub.add_parser(
        "export",
        help="write a version as a Hugging Face checkpoint directory (config, tokenizer, weights)",
        description="Rebuilds the version from its anchor and deltas and writes it with the config, "
        "tokenizer and chat template of the policy's checkpoint in the recipe: a directory that "
        "AutoModelForCausalLM / AutoTokenizer .from_pretrained load anywhere.",
    )
    _common(export)
    export.add_argument("--recipe", type=Path, required=True, help="the run's recipe (names the policy's checkpoint)")
    export.add_argument("--version", type=int, help="version (default: latest)")
    export.add_argument("out", type=Path, help="output directory (must not exist, or be empty)")
    export.set_defaults(func=cmd_export)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--policy", required=True, help="policy name")


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator:
    """The policy's :class:`WeightStore`, once the run and the policy are known to the bucket."""
    from astraflow.delta.store import WeightStore

    with command_cluster(args, run=args.run) as cfg:
        store = WeightStore.from_config(cfg, args.policy)
        require_policy(store.objects, args.run, args.policy)
        yield store


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _objects(infos: list) -> str:
    """One line per object of a version's parts."""
    return "\n".join(f"{o.key} ({_size(o.bytes)}, sha256 {o.sha256[:16]}…)" for o in infos)


def cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    with _store(args) as store:
        manifests = store.manifests()
        subs = store.subscribers()
    table = Table(title=f"{args.run} / {args.policy}: {len(manifests)} versions")
    for col in ("version", "kind", "anchor", "delta", "% of full", "sparsity", "changed", "published"):
        table.add_column(col, justify="right" if col not in ("kind", "published") else "left")
    for v, m in sorted(manifests.items()):
        table.add_row(
            str(v), m.kind,
            _size(m.anchor_bytes),
            _size(m.delta_bytes),
            f"{100 * m.delta_bytes / m.full_bytes:.2f}%" if m.delta_bytes and m.full_bytes else "-",
            f"{m.sparsity:.4%}" if m.sparsity is not None else "-",
            f"{m.changed:,}" if m.changed is not None else "-",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)),
        )
    Console().print(table)
    if subs:
        now = time.time()
        st = Table(title="subscribers")
        for col in ("id", "version", "heartbeat age"):
            st.add_column(col)
        for s in sorted(subs, key=lambda s: s.id):
            st.add_row(s.id, str(s.version), f"{now - s.heartbeat:.0f} s")
        Console().print(st)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    with _store(args) as store:
        version = args.version if args.version is not None else store.latest_version()
        if version is None:
            print(f"astraflow weights show: no version of {args.policy} is published in run {args.run}",
                  file=sys.stderr)
            return 1
        m = store.manifest(version)
    if args.json:
        print(json.dumps(m.model_dump(mode="json"), indent=2, sort_keys=True))
        return 0
    table = Table(title=f"{args.run} / {args.policy} v{version}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows = {
        "kind": m.kind, "base": str(m.base), "params": f"{m.params:,}", "full size": _size(m.full_bytes),
        "parts": str(len(m.parts)),
        "anchor": _objects([p.anchor for p in m.parts]) if m.has_anchor else "-",
        "delta": _objects([p.delta for p in m.parts]) if m.has_delta else "-",
        "changed": f"{m.changed:,}" if m.changed is not None else "-",
        "sparsity": f"{m.sparsity:.4%}" if m.sparsity is not None else "-",
        "tensors": str(len(m.tensors)), "state digest": m.state_digest,
        "published": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)),
    }
    for k, v in rows.items():
        table.add_row(k, v)
    Console().print(table)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from astraflow.delta.verify import verify_chain

    with _store(args) as store:
        results = verify_chain(store, args.from_version)
    table = Table(title=f"verify {args.run} / {args.policy}")
    for col in ("version", "kind", "result", "detail"):
        table.add_column(col)
    for r in results:
        mark = {True: "[green]ok[/]", False: "[red]FAILED[/]", None: "[yellow]skipped[/]"}[r.ok]
        table.add_row(str(r.version), r.kind, mark, r.detail)
    Console().print(table)
    failed = sum(r.ok is False for r in results)
    print(f"{len(results)} versions, {failed} failed")
    return 1 if failed else 0


def cmd_gc(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from astraflow.delta.retention import RetentionPolicy

    with _store(args) as store:
        plan = store.gc(RetentionPolicy(keep_versions=args.keep_versions, subscriber_ttl_s=args.subscriber_ttl),
                        dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    table = Table(title=f"gc {args.run} / {args.policy} (latest v{plan.latest})")
    table.add_column("version")
    table.add_column("action")
    for v in sorted(set(plan.keep) | set(plan.delete) | set(plan.orphans)):
        action = f"keep: {plan.keep[v]}" if v in plan.keep else verb + (" (unpublished leftovers)" if v in plan.orphans else "")
        table.add_row(str(v), action)
    Console().print(table)
    print(
        f"{verb} {len(plan.delete)} versions and {len(plan.orphans)} unpublished leftovers; "
        f"{len(plan.live)} live subscribers; expired subscriber records: {len(plan.expired)}"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from astraflow.config import ConfigError
    from astraflow.delta import VersionNotFoundError, WeightSubscriber
    from astraflow.delta.store import WeightStore
    from astraflow.models import policy_checkpoint_dir
    from astraflow.models.export import export_checkpoint
    from astraflow.objstore.progress import transfer_progress
    from astraflow.recipe import Recipe

    recipe = Recipe.load(args.recipe)
    try:
        spec = recipe.policy(args.policy)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None
    with command_cluster(args, run=args.run) as cfg:
        store = WeightStore.from_config(cfg, args.policy)
        require_policy(store.objects, args.run, args.policy)
        sub = WeightSubscriber(cfg, args.policy, "export", store=store, register=False)  # reads the bucket only
        try:
            plan = store.plan(None, args.version)
            with transfer_progress(store.objects, f"{args.policy} v{plan.want}", plan.bytes):
                state, version, nbytes = sub.pull(args.version)
        except VersionNotFoundError as exc:
            print(f"astraflow weights export: {exc}", file=sys.stderr)
            return 1
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # save_pretrained's shard bar: quiet off a terminal, as ours
    out = export_checkpoint(policy_checkpoint_dir(recipe, args.policy), state, args.out,
                            trust_remote_code=spec.trust_remote_code)
    print(f"{args.run} / {args.policy} v{version} -> {out} ({_size(nbytes)} pulled)")
    return 0
