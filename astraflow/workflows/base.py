"""The workflow contract: one episode of a task, possibly calling several policies.

A workflow is a class registered by name with a typed ``Config`` (a :class:`WorkflowConfig`); the
recipe's ``workflow`` section is parsed into that config when the recipe loads, so a typo in an
option is refused before any process starts. The config declares the policies the workflow calls
(:meth:`WorkflowConfig.policies`); nothing is discovered by inspecting signatures.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from astraflow.registry import PluginConfig, Registry
from astraflow.workflows.policy import PolicyClient, SamplingConfig, problem_messages, render_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from astraflow.records import Task, Trajectory
    from astraflow.tasks import Problem


@dataclass(frozen=True)
class SFTExample:
    """One supervised warm-start sequence: token ids and the tokens the model learns to produce."""

    ids: list[int]
    loss_mask: list[int]
    """1 on target tokens (the policy's own turns), 0 on prompt / tool / environment tokens."""

    @classmethod
    def completion(cls, prompt_ids: list[int], target_ids: list[int]) -> SFTExample:
        return cls([*prompt_ids, *target_ids], [0] * len(prompt_ids) + [1] * len(target_ids))


class WorkflowConfig(PluginConfig):
    """Options of a workflow (subclasses add theirs and narrow ``type``)."""

    def policies(self) -> list[str]:
        """Every policy an episode of this workflow calls, in a stable order."""
        raise NotImplementedError

    def roles(self) -> dict[str, str]:
        """Policy name -> its role in the workflow ("solver", "verifier", "agent", ...): how the
        warm start and evaluation treat it. Default: every policy is a "solver"."""
        return {p: "solver" for p in self.policies()}


class Workflow(ABC):
    """Turns a Task into trajectories by calling policies; ``None`` rejects the task (the whole
    group: a workflow never returns part of a GRPO group)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[WorkflowConfig]] = WorkflowConfig

    def __init__(self, config: WorkflowConfig) -> None:
        self.config = config
        self.counters: Counter[str] = Counter()
        """Named event counts (tool calls, tool timeouts, environment failures, ...) that the node
        publishes in its metrics records."""

    @abstractmethod
    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory] | None:
        """Trajectories of every policy the episode used (``node_id`` is left for the node to set)."""

    def warm_start_examples(self, policy: str, problems: list[Problem], tokenizer: PreTrainedTokenizerBase,
                            seed: int = 0) -> list[SFTExample]:
        """Supervised examples that teach ``policy`` its part (its output format and some skill)
        before RL. Default: the rendered prompt, then the reference answer and end of turn."""
        eos = [tokenizer.eos_token_id]
        system = getattr(self.config, "system_prompt", None)
        return [SFTExample.completion(render_messages(tokenizer, problem_messages(p, system)),
                                      [*tokenizer.encode(p.answer, add_special_tokens=False), *eos])
                for p in problems]

    async def evaluate(self, policy: str, client: PolicyClient, tasks: list[Task]) -> dict[str, Any]:
        """Held-out figures of ``policy`` (``accuracy``, ``n``, ...) with ``client`` (greedy)."""
        from astraflow.workflows.evaluate import episode_accuracy

        return await episode_accuracy(self, policy, client, tasks)

    @staticmethod
    def policy(policies: Mapping[str, PolicyClient], name: str) -> PolicyClient:
        try:
            return policies[name]
        except KeyError:
            raise ValueError(f"no policy {name!r} in this node; have {sorted(policies)}") from None


WORKFLOWS: Registry[type[Workflow]] = Registry("workflow")


def register_workflow(name: str) -> Callable[[type[Workflow]], type[Workflow]]:
    """Class decorator: make a workflow class buildable by ``name`` from a recipe."""
    return WORKFLOWS.register_class(name)


def build_workflow(config: WorkflowConfig | dict[str, Any] | str) -> Workflow:
    """The workflow named by ``config`` (a parsed config, or a recipe entry)."""
    return WORKFLOWS.build(config)


__all__ = ["WORKFLOWS", "PolicyClient", "SFTExample", "SamplingConfig", "Workflow", "WorkflowConfig", "build_workflow",
           "register_workflow"]
