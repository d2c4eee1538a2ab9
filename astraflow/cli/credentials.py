"""``astraflow credentials issue ROLE --out FILE``: one role's credential of a secured stack, as one file;
``astraflow credentials compose DIR``: the secrets of the secured compose stack (infra/docker-compose.secure.yml)."""

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
    issue.add_argument("--policy", help="with trainer: a key that writes this policy's versions and checkpoints "
                       "only (created on the running stack if missing)")
    issue.add_argument("--out", type=Path, required=True, help="file to write (refused if it exists)")
    issue.add_argument("--state-dir", type=Path, default=None, help="the secured stack's state dir "
                       "(default: the cluster config's state_dir)")
    issue.set_defaults(func=cmd_issue)
    compose = sub.add_parser(
        "compose", help="generate the secured compose stack's CA, certificates and credentials into a folder",
        description="Generate (or keep, if there) the CA, the server certificate, one credential per role, the "
        "S3 identities and the TLS terminator's configuration of infra/docker-compose.secure.yml under DIR "
        "(files 0600; those the containers read go to their uid, which takes root). Then "
        "`ASTRAFLOW_SECURE_DIR=DIR docker compose -f infra/docker-compose.secure.yml up`. Host clients: "
        "`astraflow --config DIR/host/admin.yaml ...`. See docs/compose.md.")
    compose.add_argument("dir", type=Path, help="folder of the stack's secrets (created; reused if it exists)")
    compose.add_argument("--host", action="append", default=[], metavar="NAME",
                         help="another name or address the server certificate is valid for (repeatable; "
                         "always: tls, localhost, 127.0.0.1)")
    compose.add_argument("--kafka-port", type=int, default=9093,
                         help="the log's published port, for the host's credentials (default: %(default)s, "
                         "the compose file's ASTRAFLOW_KAFKA_PORT)")
    compose.add_argument("--s3-port", type=int, default=8443,
                         help="the bucket's published port, for the host's credentials (default: %(default)s, "
                         "the compose file's ASTRAFLOW_S3_PORT)")
    compose.add_argument("--bucket", default="astraflow", help="the data bucket (default: %(default)s)")
    compose.add_argument("--uid", type=int, default=None,
                         help="the containers' user, owner of the files they read (default: 10001, infra/Dockerfile's)")
    compose.set_defaults(func=cmd_compose)


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
    identity = args.role
    if args.policy is not None:
        from astraflow.embedded import EmbeddedStack
        from astraflow.security.roles import policy_trainer

        if args.role != "trainer":
            raise ConfigError(f"--policy scopes a trainer's key; a {args.role}'s is the same for every policy")
        EmbeddedStack(cfg.state_dir, secure=True).scope_trainers([args.policy])
        identity = policy_trainer(args.policy)
    data = SecureMaterial(cfg.state_dir).credential_file(identity, stack["kafka_bootstrap"], stack["s3_endpoint"],
                                                         stack["s3_bucket"],
                                                         EMBEDDED_FETCH_MAX_WAIT_MS.get(stack.get("log_storage", "s3")))
    write_private(args.out, yaml.safe_dump(data, sort_keys=False))
    print(f"wrote the {identity} credential to {args.out} (mode 0600; it is a secret)", file=sys.stderr)
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    import sys

    from astraflow.deploy.compose_secrets import CONTAINER_UID, write_compose_secrets

    uid = CONTAINER_UID if args.uid is None else args.uid
    files = write_compose_secrets(args.dir, hosts=args.host, kafka_port=args.kafka_port, s3_port=args.s3_port,
                                  bucket=args.bucket, uid=uid)
    print(f"wrote the secured compose stack's secrets under {args.dir.absolute()} ({len(files)} files for the "
          f"containers, owned by uid {uid}; host credentials in {args.dir / 'host'})", file=sys.stderr)
    return 0
