"""The Trajectory record: one sampled episode of one policy (``<run>.trajectories``).

Per-response-token columns (``logprobs``, ``versions``, ``loss_mask``) have exactly as many entries
as ``response_ids``; :meth:`Trajectory.validate` refuses anything else, so a bad record is
dead-lettered at the edge instead of crashing a trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from astraflow.records.schema import RecordSchemaError, conform, with_identity

SCHEMA_NAME = "astraflow.trajectory"
SCHEMA_VERSION = 1

FIELDS = [
    pa.field("episode_id", pa.string(), nullable=False),
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("policy", pa.string(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("versions", pa.list_(pa.int32()), nullable=False),
    # int8: a 0/1 mask, a quarter of the bytes of int32 on long agentic trajectories.
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("rewards", pa.map_(pa.string(), pa.float64()), nullable=False),
    pa.field("turn_bounds", pa.list_(pa.int32()), nullable=False),
    pa.field("node_id", pa.string(), nullable=False),
    pa.field("created_at", pa.float64(), nullable=False),
    pa.field("gen_seconds", pa.float64(), nullable=False),
    pa.field("task_type", pa.string(), nullable=False),
]
SCHEMA = with_identity(pa.schema(FIELDS), SCHEMA_NAME, SCHEMA_VERSION)

TRUNCATED = "truncated"
"""The key of :attr:`Trajectory.rewards` that says an episode was cut by a limit (1.0: a token cap
such as ``max_new_tokens``, an agent's turn or context limit) rather than ended by the policy or its
environment (0.0). Workflows write it through their transcript; the trainer's truncated fraction
reads it."""


def episode_id_for(prompt_id: str, policy: str, sample_index: int) -> str:
    """Deterministic episode id, so that a redelivered or re-run sample is recognisable."""
    return f"{prompt_id}/{policy}/{sample_index}"


def group_id_for(prompt_id: str, policy: str) -> str:
    """Trajectories sharing this id have their advantages normalised together."""
    return f"{prompt_id}/{policy}"


@dataclass(slots=True)
class Trajectory:
    episode_id: str
    """Unique per sample: ``episode_id_for(prompt_id, policy, sample_index)``."""
    task_id: str
    """The Task's ``prompt_id``."""
    group_id: str
    """``group_id_for(prompt_id, policy)``."""
    sample_index: int
    """0 .. task.samples-1 within the group."""
    policy: str
    """Policy whose engine generated the response tokens (routes the trajectory to its trainer)."""
    prompt_ids: list[int]
    """Full context fed to the model before the first response token."""
    response_ids: list[int]
    """Tokens after the prompt (model tokens and, in multi-turn episodes, environment tokens)."""
    logprobs: list[float]
    """Behaviour log-prob of each response token (0 where ``loss_mask`` is 0)."""
    versions: list[int]
    """Weight version that produced each response token (for environment tokens: the version of
    the turn they follow)."""
    loss_mask: list[int]
    """1 for tokens the policy is trained on, 0 for environment/tool tokens."""
    reward: float
    """Scalar reward used for the advantage."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Named reward components (for logging and multi-objective plug-ins)."""
    turn_bounds: list[int] = field(default_factory=list)
    """Start offsets of each turn within ``response_ids``."""
    node_id: str = ""
    """RaaS node that produced it."""
    created_at: float = 0.0
    """Unix time the episode finished."""
    gen_seconds: float = 0.0
    """Wall time spent generating."""
    task_type: str = ""
    """Copied from the Task, usable by routing and mixing plug-ins."""

    @property
    def min_version(self) -> int:
        """Oldest weight version among the trained tokens (all tokens when none is masked in)."""
        trained = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        vs = trained or self.versions
        return min(vs) if vs else 0

    def validate(self) -> None:
        if not self.episode_id:
            raise RecordSchemaError("Trajectory.episode_id is empty")
        n = len(self.response_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            got = len(getattr(self, name))
            if got != n:
                raise RecordSchemaError(
                    f"Trajectory {self.episode_id}: {name} has {got} entries, response_ids has {n}"
                )
        if any(b < 0 or b > n for b in self.turn_bounds):
            raise RecordSchemaError(f"Trajectory {self.episode_id}: turn_bounds outside 0..{n}")


def _columns(trajectories: list[Trajectory]) -> dict[str, list]:
    for t in trajectories:
        t.validate()
    cols: dict[str, list] = {}
    for f in FIELDS:
        if f.name == "rewards":
            cols[f.name] = [list(t.rewards.items()) for t in trajectories]
        else:
            cols[f.name] = [getattr(t, f.name) for t in trajectories]
    return cols


def to_table(trajectories: list[Trajectory]) -> pa.Table:
    """Trajectories as one Arrow table in :data:`SCHEMA` (validated)."""
    return pa.Table.from_pydict(_columns(trajectories), schema=SCHEMA)


def _from_conformed(table: pa.Table) -> list[Trajectory]:
    from astraflow.records.columnar import eager_from_conformed  # imports this module

    return eager_from_conformed(table)


def from_table(table: pa.Table, *, lazy: bool = False) -> list[Trajectory]:
    """Trajectories from a table written by :func:`to_table` (extra columns ignored), validated.

    ``lazy``: the per-token lists and the reward map stay in Arrow until read
    (:class:`~astraflow.records.columnar.LazyTrajectory`), for readers that mostly judge trajectories
    by their ids, reward and ``min_version`` (offline replay)."""
    from astraflow.records.columnar import lazy_from_conformed

    conformed = conform(table, SCHEMA, SCHEMA_NAME, SCHEMA_VERSION)
    return lazy_from_conformed(conformed) if lazy else _from_conformed(conformed)
