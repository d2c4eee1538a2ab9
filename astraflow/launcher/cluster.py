"""The cluster a run uses: configured endpoints, a running embedded stack, or one started for it.

An embedded stack started here belongs to the run: the launcher restarts its servers if they die
(:class:`RunCluster.stack`), and it is stopped when the run ends (nothing is left behind). One that
was already running (``astraflow up``) is reused and left running.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.config import ClusterConfig

if TYPE_CHECKING:
    from astraflow.embedded import EmbeddedStack


@dataclass(frozen=True)
class RunCluster:
    cfg: ClusterConfig
    """Resolved to live endpoints."""
    stack: EmbeddedStack | None = None
    """The embedded stack started for the run (the run supervises and stops it), else None."""


@contextlib.contextmanager
def open_cluster(cfg: ClusterConfig, *, log_storage: str | None = None,
                 announce=print) -> Iterator[ClusterConfig]:
    """:func:`open_run_cluster`, for callers that need only the resolved config."""
    with open_run_cluster(cfg, log_storage=log_storage, announce=announce) as cluster:
        yield cluster.cfg


@contextlib.contextmanager
def open_run_cluster(cfg: ClusterConfig, *, log_storage: str | None = None,
                     announce=print) -> Iterator[RunCluster]:
    """Yield ``cfg`` resolved to live endpoints, starting the embedded stack when nothing is
    configured and none runs under ``cfg.state_dir``.

    ``log_storage`` of a stack started here: default ``$ASTRAFLOW_LOG_STORAGE``, else ``s3``, the
    durable log, kept under ``cfg.state_dir`` after the stack stops, so that ``--run-id`` of a
    stopped run finds its records (``memory``: the explicit opt-out, lost at stop).
    """
    from astraflow.embedded import EmbeddedStack, StackError, StackPorts
    from astraflow.embedded.tansu import default_log_storage
    from astraflow.launcher.interrupts import interrupt_guard

    if not cfg.is_embedded:
        yield RunCluster(cfg)
        return
    stack = EmbeddedStack(cfg.state_dir)
    if stack.running_endpoints() is not None:
        announce(f"using the embedded stack already running under {stack.state_dir}")
        yield RunCluster(cfg.resolve())
        return
    # The default ports when they are free (``astraflow status`` then finds the stack), else
    # random free ones: a busy port must not stop a run.
    ports = StackPorts()
    if ports.taken():
        ports = None
    announce(f"starting the embedded stack (Kafka + S3) under {stack.state_dir} ...")
    with interrupt_guard() as guard:
        try:
            stack, result = EmbeddedStack.start_private(cfg.state_dir, ports=ports,
                                                          storage=log_storage or default_log_storage())
        except StackError as exc:
            raise StackError(f"cannot start the embedded stack: {exc}") from None
        except BaseException:
            # Ctrl+C / SIGTERM during start-up: stop whatever already started (found by pid file).
            with guard.shielded():
                stack.down()
            raise
        try:
            ep = result.endpoints
            announce(f"embedded stack up: Kafka {ep['kafka_bootstrap']}, S3 {ep['s3_endpoint']} "
                     f"({', '.join(f'{k} {v:.1f} s' for k, v in result.seconds.items())})")
            yield RunCluster(cfg.resolve(), stack)
        finally:
            with guard.shielded():
                stack.down()
                announce("embedded stack stopped")


SECRET_FIELDS = {"kafka": ("sasl_password", "ssl_key_pem"), "s3": ("access_key", "secret_key"),
                 "region": ("access_key", "secret_key")}
"""What a config with a ``credentials_file`` never copies, whatever that file holds."""


def write_cluster_file(cfg: ClusterConfig, path: Path) -> Path:
    """The resolved cluster config as YAML for the children, mode 0600. With a credential file
    (a secured cluster) it names that file and holds no secret; else it holds the S3 key."""
    import os

    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(cfg.model_dump_json(exclude_none=True))
    if cfg.credentials_file is not None:
        # What the credential file provides is read from it (a component may be handed another
        # role's file: ASTRAFLOW_CREDENTIALS_FILE), never copied.
        from astraflow.config import read_yaml_mapping

        provided = read_yaml_mapping(cfg.credentials_file, "credential file")
        for section, fields in [*SECRET_FIELDS.items(), *provided.items()]:
            if isinstance(fields, dict | tuple):
                for field in fields:
                    data.get(section, {}).pop(field, None)
            else:
                data.pop(section, None)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path
