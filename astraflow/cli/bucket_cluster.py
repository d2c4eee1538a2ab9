"""The cluster of a command that reads the broker or the bucket (``weights``, ``runs``, ``replay``,
``archive``), and the one-line answers to what commonly stands in its way.

Where nothing is configured, such a command finds the embedded stack as ``astraflow run`` does: the
one running under the state dir, else one it starts there for as long as the command runs (the data
of earlier runs lives in that state dir, and a run stops the stack it started). A state dir that
holds no data is not worth a start: the command says in one line what to start instead.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from astraflow.cli.cluster_args import load_cluster
from astraflow.config import ConfigError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore

SEAWEEDFS_DATA = "seaweedfs"
"""The embedded S3 server's data folder under the state dir (:meth:`EmbeddedStack.start_service`)."""


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # stdout stays the command's answer (tables, JSON)


@contextlib.contextmanager
def command_cluster(args: argparse.Namespace, run: str | None = None) -> Iterator[ClusterConfig]:
    """The command's cluster config (with ``run`` where given), resolved to live endpoints; an
    embedded stack started here is stopped when the block ends."""
    from astraflow.embedded import EmbeddedStack
    from astraflow.launcher.cluster import open_cluster

    cfg = load_cluster(args)
    if run is not None:
        cfg = cfg.model_copy(update={"run": run})
    if not cfg.is_embedded:
        yield cfg.resolve()
        return
    stack = EmbeddedStack(cfg.state_dir)
    if stack.running_endpoints() is None and not (stack.state_dir / SEAWEEDFS_DATA).is_dir():
        raise ConfigError(
            f"no embedded stack runs under {stack.state_dir} and it holds no data: start one with "
            "`astraflow up` (or train with `astraflow run RECIPE`), set --state-dir / $ASTRAFLOW_STATE_DIR to "
            "the one your runs used, or point --config / $ASTRAFLOW_S3_ENDPOINT at your cluster")
    with open_cluster(cfg, announce=_note) as resolved:
        yield resolved


def require_run(store: ObjectStore, run: str) -> None:
    """One line (:class:`ConfigError`) when the bucket holds nothing of ``run``."""
    if next(iter(store.list(f"{run}/", page_size=1)), None) is not None:
        return
    if next(iter(store.list("", page_size=1)), None) is None:
        raise ConfigError(f"no run {run!r}: s3://{store.bucket}/ holds no run yet (train one with "
                          "`astraflow run RECIPE`)")
    raise ConfigError(f"no run {run!r} in s3://{store.bucket}/ (`astraflow runs ls` lists the runs there)")


def require_policy(store: ObjectStore, run: str, policy: str) -> None:
    """One line (:class:`ConfigError`) when ``run`` is not in the bucket or holds no weights of ``policy``."""
    from astraflow.objstore.layout import RunLayout

    require_run(store, run)
    prefix = RunLayout(run).weights_prefix(policy)
    if next(iter(store.list(prefix, page_size=1)), None) is not None:
        return
    from astraflow.objstore.runs import list_runs

    found = list_runs(store, run)
    policies = found[0].policies if found else []
    raise ConfigError(f"run {run!r} has no weights of policy {policy!r}; "
                      + (f"its policies: {', '.join(policies)}" if policies else "it has published no weights yet"))
