"""The ``dataflow`` section of a recipe."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.dataflow.autoscaler import AutoscaleConfig
from astraflow.dataflow.plugins import FilterSpec, SamplerSpec, SelectorSpec


class DataflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["async", "sync"] = "async"
    """``async``: keep up to ``in_flight_cap`` tasks out, bounded by staleness. ``sync`` (on-policy
    barrier): emit one wave of tasks for the current version, wait until every task of the wave is
    finished, and emit the next wave only after newer weights are announced."""
    policies: list[str] = Field(default_factory=lambda: ["default"], min_length=1)
    """Policies trained in this run; a task with ``policy=""`` yields one group for each."""
    groups_per_batch: int = Field(default=8, ge=1)
    """Groups (one task x one policy, ``samples`` trajectories each) per training batch."""
    max_staleness: int = Field(default=1, ge=0)
    """A trajectory is dropped when current version - its oldest trained token's version exceeds this."""
    stale_tokens: Literal["drop", "mask"] = "drop"
    """What a trajectory staler than ``max_staleness`` loses. ``drop``: all of it (counted ``stale``).
    ``mask``: only its stale tokens, which get ``loss_mask`` 0. A node that refreshes mid-episode
    continues a long rollout under the newer weights and tags each token with its version, so the
    episode's later tokens are fresh: they are trained and the early ones are not. The trajectory is
    still dropped as ``stale`` when none of its trained tokens is fresh enough (counted apart:
    ``partly_stale`` trajectories, ``stale_tokens_masked`` tokens). The bound holds for every
    trained token either way."""
    max_in_flight: int | None = Field(default=None, ge=1)
    """Cap on emitted-but-unfinished tasks; default ``groups_per_batch * (max_staleness + 1)``, and
    then (async) also no more tasks than the trainer can consume within ``max_staleness`` versions
    (``Dataflow.staleness_room``), and staleness is measured against the version that will train
    the group (``Dataflow.train_version``). An explicit value is a plain cap and staleness is
    measured against the announced version: batches queued at a slow trainer may be trained staler."""
    emission_slack: int = Field(default=0, ge=0)
    """Async: versions of ``max_staleness`` kept free when emitting. Tasks are emitted only while
    every group would be trained within ``max_staleness - emission_slack`` versions of its emission
    (``Dataflow.staleness_room``); the ingest filter still allows ``max_staleness``. A trainer-bound
    run otherwise keeps the pipeline full to the bound, so a group finishing late (a long tail, or a
    multi-phase episode whose first samples wait for the last phase) is trained beyond it. 0: emit
    up to the bound."""
    emit_ahead: bool = True
    """Async: emit the tasks of the next version as soon as the batch that trains it is served, tagged
    with that version; a node holds them until it serves it. Without it they are emitted only once the
    dataflow has read the version's announcement, so every step waits for announcement -> dataflow ->
    task -> node instead of announcement -> node. At most ``(max_staleness - emission_slack) x
    groups_per_batch`` tasks wait so (none at ``max_staleness: 0``). Off with an explicit
    ``max_in_flight`` and in sync mode."""
    batch_lookahead: int | None = Field(default=None, ge=1)
    """Batches served ahead of the trainer: a full batch waits in the sampler until fewer than this
    many are untrained (judged from the announced versions, which lag by the trainer's publish lag).
    ``None`` serves every full batch at once. With ``sampler: oldest_first`` the waiting groups are
    served oldest token version first (earliest deadline first)."""
    candidate_pool: int = Field(default=64, ge=1)
    """Dataset tasks drawn ahead so that the task selector has a choice."""
    epochs: int | None = Field(default=None, ge=1)
    """Passes over the dataset; ``None`` cycles forever."""
    dedup_window: int | None = Field(default=None, ge=0)
    """Tasks whose episode ids stay remembered after they leave flight (finished or expired), so that
    a late copy of their trajectories is counted ``duplicate``; a copy later than that is dropped as
    ``unknown_task`` (dropped either way: only tasks in flight are trained, and their episode ids are
    always remembered). ``None``: ``16 x in_flight_cap``, about 16 rollouts' worth of tasks (by
    Little's law the tasks in flight are those that finish within one rollout). Saved with the
    state (:mod:`astraflow.dataflow.dedup`), so the state does not grow with the run."""
    dedup_capacity: int = Field(default=200_000, ge=1)
    """Episode ids remembered beyond those of the tasks in flight (oldest forgotten first): those of
    the ``dedup_window`` tasks, and in an archive replay (where every task counts as known and none
    is in flight) all of them."""
    min_group_samples: int = Field(default=2, ge=1)
    """A finished group with fewer surviving trajectories is dropped (counted ``group_too_small``)."""
    task_timeout_s: float | None = Field(default=900.0, gt=0)
    """A task unfinished after this long is expired (counted): covers rejected episodes (a
    workflow returning None) and lost nodes. ``None`` never expires."""
    route_pools: dict[str, int] = Field(default_factory=dict)
    """Spread tasks over several pools: pool name -> episode slots (nodes x concurrency). Each task
    goes to the pool with the most free slots (slots - its tasks in flight); a faster pool frees
    slots sooner and so receives more tasks, and every pool keeps receiving work. Empty: every task
    goes to the pool its dataset names."""
    selector: SelectorSpec = Field(default_factory=lambda: SelectorSpec(type="accept_all"))
    """Before-rollout task selection plug-in (a name, or ``{type, options}``)."""
    filters: list[FilterSpec] = Field(default_factory=list)
    """After-rollout group filters, applied in order."""
    sampler: SamplerSpec = Field(default_factory=lambda: SamplerSpec(type="fifo"))
    """Batch-serving plug-in; one instance per policy."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Advisory node-count report."""

    @model_validator(mode="after")
    def _slack_within_bound(self) -> DataflowConfig:
        if self.emission_slack > self.max_staleness:
            raise ValueError(f"emission_slack ({self.emission_slack}) cannot exceed max_staleness "
                             f"({self.max_staleness})")
        return self

    @property
    def in_flight_cap(self) -> int:
        return self.max_in_flight or self.groups_per_batch * (self.max_staleness + 1)

    @property
    def dedup_window_tasks(self) -> int:
        return 16 * self.in_flight_cap if self.dedup_window is None else self.dedup_window
