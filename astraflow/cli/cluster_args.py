"""The cluster config a command runs against, from the global ``--config`` and its ``--state-dir``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


def load_cluster(args: argparse.Namespace) -> ClusterConfig:
    """``--config`` (else ``$ASTRAFLOW_CONFIG``) overlaid with ``ASTRAFLOW_*``, with the command's
    ``--state-dir`` (where it has one) in place of the config's. Not resolved: ``up``/``run``
    decide whether an embedded stack is to be started first."""
    from astraflow.config import ClusterConfig

    cfg = ClusterConfig.load(getattr(args, "config", None))
    state_dir = getattr(args, "state_dir", None)
    if state_dir is not None:
        cfg = cfg.model_copy(update={"state_dir": state_dir})
    return cfg
