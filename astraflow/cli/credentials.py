"""``astraflow credentials issue ROLE --out FILE``: one role's credential of a secured stack, as one file."""

from __future__ import annotations

import argparse
from pathlib import Path

from astraflow.cli.cluster_args import load_cluster


def register(subparsers: argparse._SubParsersAction) -> None:
    from astraflow.security.roles import ROLES

    creds = subparsers.add_parser(
        "credentials", help="hand out a role's credential of a secured stack (astraflow up --secure)")
    sub = creds.add_subparsers(dest="credentials_command", metavar="COMMAND", required=True)
    issue = sub.add_parser(
        "issue", help="write one role's credential as a single file for another machine",
        description="Write a cluster config (mode 0600) holding the secured stack's endpoints, its CA, the "
        "role's client certificate and key and its S3 keys. On the other machine: `astraflow node --cluster "
        "FILE --recipe ...` (or `astraflow --config FILE <component> ...`). It is a secret: copy it over a "
        "secure channel. docs/security.md lists what each role may do.")
    issue.add_argument("role", choices=[r for r in ROLES if r != "admin"])
    issue.add_argument("--out", type=Path, required=True, help="file to write (refused if it exists)")
    issue.add_argument("--state-dir", type=Path, default=None, help="the secured stack's state dir "
                       "(default: the cluster config's state_dir)")
    issue.set_defaults(func=cmd_issue)


def cmd_issue(args: argparse.Namespace) -> int:
    import json
    import sys

    import yaml

    from astraflow.config import EMBEDDED_FETCH_MAX_WAIT_MS, STACK_FILE, ConfigError
    from astraflow.security.material import SecureMaterial, write_private

    cfg = load_cluster(args)
    stack_file = cfg.state_dir / STACK_FILE
    stack = json.loads(stack_file.read_text()) if stack_file.exists() else {}
    if not stack.get("credentials_file"):
        raise ConfigError(f"no secured stack runs under {cfg.state_dir}: start one with `astraflow up --secure`")
    if args.out.exists():
        raise ConfigError(f"{args.out} exists: a credential is not overwritten (remove it first)")
    data = SecureMaterial(cfg.state_dir).credential_file(args.role, stack["kafka_bootstrap"], stack["s3_endpoint"],
                                                         stack["s3_bucket"],
                                                         EMBEDDED_FETCH_MAX_WAIT_MS.get(stack.get("log_storage", "s3")))
    write_private(args.out, yaml.safe_dump(data, sort_keys=False))
    print(f"wrote the {args.role} credential to {args.out} (mode 0600; it is a secret)", file=sys.stderr)
    return 0
