"""One policy's side of a multi-turn episode, kept as token ids exactly as the engine saw them.

Invariant (the exact-prefix rule): the context given to the engine for turn k+1 is
``prompt_ids + response_ids`` after turn k, byte for byte; nothing is ever decoded and re-encoded.
Generated tokens keep their behaviour log-probs and weight versions and get ``loss_mask`` 1;
tokens the policy did not sample (tool results, environment observations, chat-template framing)
get ``loss_mask`` 0, log-prob 0.0 and the version of the turn they follow. ``turn_bounds`` lists the
offset of every segment boundary in ``response_ids``, from 0 to the length: model and observation
segments alternate, a model segment first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astraflow.engines.base import Generation
from astraflow.records.trajectory import TRUNCATED

if TYPE_CHECKING:
    from astraflow.records import Task, Trajectory


@dataclass
class Transcript:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_bounds: list[int] = field(default_factory=lambda: [0])
    model_turns: int = 0
    gen_seconds: float = 0.0
    cut: bool = False
    """The last model turn ended at its token cap (finish_reason "length"), not at a stop token."""

    def context(self) -> list[int]:
        """What the engine is given for the next turn: the prompt and every response token so far."""
        return [*self.prompt_ids, *self.response_ids]

    def __len__(self) -> int:
        """Total tokens (prompt + response)."""
        return len(self.prompt_ids) + len(self.response_ids)

    def add_generation(self, gen: Generation, seconds: float = 0.0) -> None:
        """A model turn: trained tokens with their behaviour log-probs and versions."""
        if not (len(gen.token_ids) == len(gen.logprobs) == len(gen.versions)):
            raise ValueError("generation: token_ids, logprobs and versions differ in length")
        self._extend(gen.token_ids, gen.logprobs, gen.versions, 1)
        self.model_turns += 1
        self.cut = gen.finish_reason == "length"
        self.gen_seconds += seconds

    def add_observation(self, token_ids: list[int]) -> None:
        """Tokens the policy did not sample (masked out, never behaviour log-probs)."""
        version = self.versions[-1] if self.versions else 0
        self._extend(token_ids, [0.0] * len(token_ids), [version] * len(token_ids), 0)

    def _extend(self, ids: list[int], logprobs: list[float], versions: list[int], mask: int) -> None:
        if not ids:
            return
        # two model (or two observation) pieces in a row stay one segment: kinds alternate
        same_kind = bool(self.loss_mask) and self.loss_mask[-1] == mask
        self.response_ids.extend(int(t) for t in ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.loss_mask.extend([mask] * len(ids))
        if same_kind:
            self.turn_bounds[-1] = len(self.response_ids)
        else:
            self.turn_bounds.append(len(self.response_ids))

    def to_trajectory(self, task: Task, policy: str, index: int, reward: float,
                      rewards: dict[str, float] | None = None) -> Trajectory:
        """The transcript as the policy's trajectory for sample ``index`` of ``task``. Its ``rewards``
        figures carry ``truncated`` (1.0: the episode ended at a token cap), unless the workflow's own
        figures say it (an agent loop also counts its turn and context limits): the trainer's
        truncated fraction reads it."""
        from astraflow.records import Trajectory, episode_id_for, group_id_for

        figures = {TRUNCATED: float(self.cut), **(rewards or {})}

        return Trajectory(
            episode_id=episode_id_for(task.prompt_id, policy, index),
            task_id=task.prompt_id,
            group_id=group_id_for(task.prompt_id, policy),
            sample_index=index,
            policy=policy,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            loss_mask=list(self.loss_mask),
            reward=float(reward),
            rewards=figures,
            turn_bounds=list(self.turn_bounds) if len(self.turn_bounds) > 1 else [0, 0],
            node_id="",
            created_at=time.time(),
            gen_seconds=self.gen_seconds,
            task_type=task.task_type,
        )
