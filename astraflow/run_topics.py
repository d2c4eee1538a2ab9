"""The run's topics as a component that starts before the launcher made them creates them (a RaaS
node or the dataflow started on its own, not by ``astraflow run``, may be the first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


def ensure_run_topics(cfg: ClusterConfig, pools: dict[str, int], policies: list[str]) -> None:
    """Create the run's topics that do not exist yet with the launcher's partition counts
    (:meth:`~astraflow.log.Topics.partitions`; ``pools``: pool -> its most nodes), all but the dead
    letters, which are left to their publisher (:mod:`astraflow.log.dead_letters`)."""
    from astraflow.log import Topics, ensure_topics

    topics = Topics(cfg.run)
    run_topics = topics.partitions(pools, policies)
    ensure_topics(cfg, {t: n for t, n in run_topics.items() if t != topics.dead_letters})
