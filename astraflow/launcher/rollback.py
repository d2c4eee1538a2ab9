"""``astraflow run --run-id R --from-checkpoint STEP``: restart run R from an older kept checkpoint.

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

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.recipe import Recipe


def roll_back(cfg: ClusterConfig, recipe: Recipe, step: int, say: Callable[[str], None]) -> None:
    """Make step ``step`` every policy's latest checkpoint in run ``cfg.run``; :class:`CheckpointError`
    (nothing changed) when a policy keeps none of that step."""
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointError, CheckpointStore

    store = ObjectStore.from_config(cfg)
    stores = {p.name: CheckpointStore(store, cfg.run, p.name) for p in recipe.policies}
    missing = {name: kept for name, s in stores.items() if step not in (kept := s.kept_steps())}
    if missing:
        keeps = "; ".join(f"policy {name} keeps steps {kept or 'none'}" for name, kept in missing.items())
        raise CheckpointError(f"run {cfg.run} cannot roll back to checkpoint step {step}: {keeps}")
    for name, checkpoints in stores.items():
        pointer = checkpoints.roll_back(step)
        say(f"{name}: rolled back to checkpoint step {step} (version {pointer['version']}); its trainer resumes "
            f"from it and trains the batches after it again")
