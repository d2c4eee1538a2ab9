"""``astraflow run --run-id R --from-checkpoint STEP``: restart run R from an older kept checkpoint
(``astraflow runs rollback R STEP`` does the same step alone, for a run whose trainers are started by
something else, e.g. a Kubernetes Deployment: stop them, roll back, start them).

Before any component starts, every policy's kept checkpoint of step STEP becomes its latest (its step
folder's copy of the pointer over ``latest.json``, :meth:`CheckpointStore.roll_back
<astraflow.trainer.checkpoint.CheckpointStore.roll_back>`); a policy without one refuses the whole
rollback, naming the steps it keeps, before anything changes. The trainer then resumes from it as from
any checkpoint: it announces the checkpoint's weights under a version above every one published (the
versions the rolled-back steps published stay in the past; a node only moves forward), and reads its
batch topic from the checkpoint's consumed offsets, which its rollback position kept in the log
(:mod:`astraflow.log.retention`), training the batches after STEP again. The dataflow, the nodes and the
archiver carry on from their own saved positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


def roll_back(cfg: ClusterConfig, policies: Iterable[str], step: int, say: Callable[[str], None]) -> None:
    """Make step ``step`` the latest checkpoint of every one of ``policies`` in run ``cfg.run``;
    :class:`CheckpointError` (nothing changed) when one of them keeps none of that step."""
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointError, CheckpointStore

    store = ObjectStore.from_config(cfg)
    stores = {policy: CheckpointStore(store, cfg.run, policy) for policy in policies}
    missing = {name: kept for name, s in stores.items() if step not in (kept := s.kept_steps())}
    if missing:
        keeps = "; ".join(f"policy {name} keeps steps {kept or 'none'}" for name, kept in missing.items())
        raise CheckpointError(f"run {cfg.run} cannot roll back to checkpoint step {step}: {keeps}")
    for name, checkpoints in stores.items():
        pointer = checkpoints.roll_back(step)
        say(f"{name}: rolled back to checkpoint step {step} (version {pointer['version']}); its trainer resumes "
            f"from it and trains the batches after it again")
