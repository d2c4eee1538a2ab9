"""Consumer-group ids of one run: ``<run>.raas.<pool>``, ``<run>.trainer.<policy>``, ``<run>.dataflow``,
``<run>.archive``.

A group's members share its topics' partitions and its committed offsets, so these names are a
contract like the topic names: the components join them, and whatever watches a group from outside
(``astraflow run``'s checks, a KEDA ``ScaledObject`` scaling a pool on its lag) must name the same.
"""

from __future__ import annotations

from astraflow.log.topics import Topics, _part


class ConsumerGroups:
    """The consumer-group ids of run ``run`` (validated like its topic names)."""

    def __init__(self, run: str) -> None:
        self.run = Topics(run).run

    def raas(self, pool: str) -> str:
        """The RaaS nodes of pool ``pool``, on ``<run>.tasks.<pool>``: one task goes to one node."""
        return f"{self.run}.raas.{_part('pool', pool)}"

    def trainer(self, policy: str) -> str:
        """The trainer of ``policy`` on ``<run>.batches.<policy>``."""
        return f"{self.run}.trainer.{_part('policy', policy)}"

    def trainer_rollback(self, policy: str) -> str:
        """The batches of ``policy`` that a rollback to its oldest kept checkpoint trains again: never
        joined, its offsets (that checkpoint's consumed offsets) committed by the trainer after each save
        (:mod:`astraflow.log.positions`), so that log retention keeps them."""
        return f"{self.run}.trainer-rollback.{_part('policy', policy)}"

    @property
    def dataflow(self) -> str:
        """The dataflow on trajectories, metrics and weight announcements."""
        return f"{self.run}.dataflow"

    @property
    def dataflow_recovery(self) -> str:
        """The dataflow's recovery read-back on its own task and batch records: never joined, its
        offsets committed with each state save (:mod:`astraflow.log.positions`), so that log retention
        keeps what a restarted dataflow reads back, however long it was down."""
        return f"{self.run}.dataflow-recovery"

    @property
    def archive(self) -> str:
        """The archiver on every topic it writes to Parquet."""
        return f"{self.run}.archive"

    def __repr__(self) -> str:
        return f"ConsumerGroups({self.run!r})"
