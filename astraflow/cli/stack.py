"""``astraflow up | down | status``: the embedded Kafka broker (Tansu) and S3 server (SeaweedFS)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from astraflow.cli.cluster_args import load_cluster
from astraflow.embedded.tansu import DEFAULT_LOG_STORAGE, LOG_STORAGE_ENV, LOG_STORAGES

ENV_HELP = "(env {})"


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up",
        help="start the embedded Kafka broker and S3 server on loopback",
        description=(
            "Start a real Kafka-protocol broker (Tansu) and a real S3 server (SeaweedFS) bound to "
            "127.0.0.1, wait until both answer, and write <state-dir>/stack.json, from which every "
            "component finds them. Running it again while the stack runs only reports the endpoints."
        ),
    )
    _state_dir_arg(up)
    up.add_argument(
        "--log-storage",
        choices=list(LOG_STORAGES),
        default=os.environ.get(LOG_STORAGE_ENV) or DEFAULT_LOG_STORAGE,
        help="where the broker keeps the log: 's3' = durable, in the embedded S3 server's 'tansu' "
        "bucket under the state dir (survives down/up, a crash, a reboot); 'memory' = faster "
        "produce, lost at down (default: %(default)s) " + ENV_HELP.format(LOG_STORAGE_ENV),
    )
    up.add_argument(
        "--kafka-port", type=int, default=_env_int("ASTRAFLOW_KAFKA_PORT", 9092),
        help="Kafka listener port (default: %(default)s) " + ENV_HELP.format("ASTRAFLOW_KAFKA_PORT"),
    )
    up.add_argument(
        "--s3-port", type=int, default=_env_int("ASTRAFLOW_S3_PORT", 8333),
        help="S3 API port (default: %(default)s) " + ENV_HELP.format("ASTRAFLOW_S3_PORT"),
    )
    up.add_argument(
        "--internal-port-base", type=int, default=_env_int("ASTRAFLOW_INTERNAL_PORT_BASE", 18331),
        help="SeaweedFS's internal listeners use this port and the next 9, plus this + 10009 "
        "(default: %(default)s) " + ENV_HELP.format("ASTRAFLOW_INTERNAL_PORT_BASE"),
    )
    up.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for each service (default: %(default)s)"
    )
    up.add_argument(
        "--secure", action="store_true",
        help="a stack for remote nodes (docs/security.md): TLS on both public ports (stunnel), a client "
        "certificate required on the log, one S3 identity per role on the bucket; the CA, certificates and "
        "credentials are generated under <state-dir>/secure/ (0600). Hand a node its credential with "
        "`astraflow credentials issue node --out node.yaml`",
    )
    up.add_argument("--bind", default="127.0.0.1", metavar="HOST",
                    help="with --secure: address the two public listeners bind (0.0.0.0: every interface; "
                    "the servers themselves stay on loopback) (default: %(default)s)")
    up.add_argument("--advertise", default=None, metavar="HOST",
                    help="with --secure: the host name or address other machines reach this one by (in the "
                    "server certificate and the broker's metadata) (default: --bind, or 127.0.0.1)")
    up.set_defaults(func=cmd_up)

    down = subparsers.add_parser(
        "down",
        help="stop the embedded stack (data in the state dir is kept)",
        description="Stop the broker, then the S3 server (SIGTERM, SIGKILL after --timeout), and remove "
        "stack.json. Data, logs and S3 credentials stay in the state dir.",
    )
    _state_dir_arg(down)
    down.add_argument(
        "--timeout", type=float, default=10.0, help="seconds before SIGKILL (default: %(default)s)"
    )
    down.set_defaults(func=cmd_down)

    status = subparsers.add_parser(
        "status",
        help="show the embedded stack's processes and the cluster config components will use",
        description="One row per embedded service (pid, endpoint, alive), then the run config "
        "resolved from --config / ASTRAFLOW_* / stack.json. Exit status 0 when the cluster resolves "
        "and every embedded service that should run is alive, 1 otherwise.",
    )
    _state_dir_arg(status)
    status.set_defaults(func=cmd_status)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the stack keeps data, logs, pid files and stack.json (default: the cluster "
        "config's state_dir, i.e. $ASTRAFLOW_STATE_DIR or ./.astraflow)",
    )


def cmd_up(args: argparse.Namespace) -> int:
    from rich.console import Console

    from astraflow.embedded import EmbeddedStack, StackError, StackPorts

    console = Console()
    cfg = load_cluster(args)
    try:
        ports = StackPorts.plan(args.kafka_port, args.s3_port, args.internal_port_base)
    except ValueError as exc:
        console.print(f"[red]invalid port:[/red] {exc}")
        return 2
    stack = EmbeddedStack(cfg.state_dir, ports, storage=args.log_storage, start_timeout_s=args.timeout,
                          secure=args.secure, bind_host=args.bind if args.secure else "127.0.0.1",
                          advertise_host=args.advertise)
    try:
        result = stack.up()
    except StackError as exc:
        console.print(f"[red]astraflow up failed:[/red] {exc}", markup=True, highlight=False)
        return 1
    ep = result.endpoints
    if result.already_running:
        console.print(f"Embedded stack already running under {stack.state_dir} (nothing started).")
    else:
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        console.print(f"Embedded stack started under {stack.state_dir} ({timing}).")
    _print_endpoints(console, ep)
    if ep.get("log_storage") == "memory":
        console.print("[yellow]log storage is 'memory': topics are lost at `astraflow down`.[/yellow]")
    return 0


def _print_endpoints(console, ep: dict) -> None:
    from rich.table import Table

    table = Table(title="AstraFlow embedded stack")
    table.add_column("what")
    table.add_column("value")
    table.add_column("env to use it elsewhere")
    table.add_row("Kafka bootstrap", ep["kafka_bootstrap"], "ASTRAFLOW_KAFKA_BOOTSTRAP")
    table.add_row("S3 endpoint", ep["s3_endpoint"], "ASTRAFLOW_S3_ENDPOINT")
    table.add_row("S3 bucket", ep["s3_bucket"], "ASTRAFLOW_S3_BUCKET")
    if ep.get("credentials_file"):
        table.add_row("operator credential", ep["credentials_file"], "ASTRAFLOW_CREDENTIALS_FILE")
        table.add_row("a node's credential", "astraflow credentials issue node --out node.yaml", "")
    else:
        table.add_row("S3 access key", ep["s3_access_key"], "ASTRAFLOW_S3_ACCESS_KEY")
        table.add_row("S3 secret key", "(in stack.json)", "ASTRAFLOW_S3_SECRET_KEY")
    table.add_row("log storage", ep.get("log_storage", "?"), "")
    console.print(table)


def cmd_down(args: argparse.Namespace) -> int:
    from rich.console import Console

    from astraflow.embedded import EmbeddedStack

    console = Console()
    cfg = load_cluster(args)
    stack = EmbeddedStack(cfg.state_dir)
    stopped = stack.down(timeout_s=args.timeout)
    left = [row for row in stack.status() if row.alive]
    if left:
        console.print(f"[red]still running:[/red] {', '.join(f'{r.service} pid {r.pid}' for r in left)}")
        return 1
    if stopped:
        console.print(f"Stopped {', '.join(stopped)} under {stack.state_dir}. Data kept.")
    else:
        console.print(f"Nothing was running under {stack.state_dir}.")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from astraflow.config import ConfigError
    from astraflow.embedded import EmbeddedStack

    console = Console()
    cfg = load_cluster(args)
    stack = EmbeddedStack(cfg.state_dir)
    rows = stack.status()
    table = Table(title=f"embedded stack under {stack.state_dir}")
    for col in ("service", "pid", "endpoint", "alive"):
        table.add_column(col)
    for row in rows:
        alive = "[green]yes[/green]" if row.alive else "[red]no[/red]"
        table.add_row(row.service, str(row.pid or "-"), row.endpoint, alive)
    console.print(table)

    ok = True
    try:
        resolved = cfg.resolve()
    except ConfigError as exc:
        console.print(f"[red]cluster config does not resolve:[/red] {exc}", highlight=False)
        return 1
    if cfg.is_embedded:
        ok = all(row.alive for row in rows)
        if not ok:
            console.print("[red]the embedded stack is only partly running: `astraflow down` then `astraflow up`.[/red]")
    run = Table(title="cluster config (what components will use)")
    run.add_column("setting")
    run.add_column("value")
    run.add_row("run", resolved.run)
    run.add_row("kafka.bootstrap", resolved.kafka.bootstrap or "")
    run.add_row("kafka.security_protocol", resolved.kafka.security_protocol)
    run.add_row("s3.endpoint", resolved.s3.endpoint or "")
    run.add_row("s3.bucket", resolved.s3.bucket)
    run.add_row("source", "embedded stack (stack.json)" if cfg.is_embedded else "config / environment")
    console.print(run)
    return 0 if ok else 1
