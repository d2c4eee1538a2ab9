"""A recipe: everything one RL run needs besides the cluster — model, data, workflow, policies,
rollout pools, dataflow plug-ins and hyper-parameters. YAML, validated here with readable errors.

Each section's fields are documented in the config class that owns them (``DataflowConfig``,
``BackendConfig``, ``EngineConfig``, ``SamplingConfig``, ``SFTConfig``, ``ModelConfig``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from astraflow.config import ConfigError, read_yaml_mapping
from astraflow.dataflow.config import DataflowConfig
from astraflow.engines import EngineConfig
from astraflow.sft import SFTConfig
from astraflow.trainer.backend import BackendConfig
from astraflow.workflows.base import SamplingConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetSpec(_Section):
    type: str = "arithmetic"
    """A dataset registered in ``astraflow.tasks`` (``astraflow.tasks.DATASETS``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset class (seed, held-out fraction, difficulty, ...)."""
    task_type: str = "math"
    """Written on each Task; routing and mixing plug-ins can key on it."""
    samples: int = Field(default=8, ge=1)
    """Trajectories per task and policy (the GRPO group size)."""
    pool: str = "default"
    """Rollout pool whose task topic receives the tasks."""


class WorkflowSpec(_Section):
    type: str = "math"
    """A workflow registered in ``astraflow.workflows`` ("math", "solver_verifier", ...)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the workflow class (policy names, reward plug-in, sampling)."""


class PolicySpec(_Section):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    """Policy id: names its batch and weight topics and its bucket prefix."""
    model: str = "examples/models/tiny.yaml"
    """Model config YAML (relative to the recipe file or the working directory)."""
    backend: BackendConfig = Field(default_factory=BackendConfig)
    """Trainer backend and optimiser hyper-parameters."""
    sft: SFTConfig | None = None
    """Supervised warm start before RL (``None``: start from the initialised model)."""


class PoolSpec(_Section):
    name: str = Field(default="default", pattern=r"^[a-z][a-z0-9_-]*$")
    """Pool id: names the task topic ``<run>.tasks.<pool>`` and its consumer group."""
    nodes: int = Field(default=1, ge=0)
    """RaaS nodes the launcher starts for this pool (more can join from anywhere)."""
    concurrency: int = Field(default=8, ge=1)
    """Episodes a node runs at once."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Inference engine of the pool's nodes."""


class TrainerSpec(_Section):
    steps: int = Field(default=40, ge=1)
    """Optimizer steps per policy; the run ends when every trainer reached it."""
    anchor_every: int = Field(default=10, ge=1)
    """A full checkpoint (anchor) every K versions; deltas in between."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Trainer state (model, optimizer, consumed offsets) saved every N steps."""
    max_publish_lag: int = Field(default=2, ge=1)
    """The trainer blocks only when more than this many versions wait to be published."""
    publish_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the published (served) weights. The trainer keeps fp32 master weights and fp32
    checkpoints; every published version (v0 included, also the demo's) is a cast of them, as in
    AstraFlow and TRL. bf16 makes each version a sparse delta (an update that does not move a weight
    past a bf16 rounding boundary changes no bit); the small train/serve mismatch is corrected by
    the PPO importance ratio against the behaviour log-probs the nodes record."""


class EvalSpec(_Section):
    prompts: int = Field(default=200, ge=1)
    """Held-out prompts scored (greedy) before and after RL."""


class Recipe(_Section):
    run: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run id (topic and bucket prefix). ``astraflow run --run-id`` overrides it."""
    seed: int = 0
    """Seed of model initialisation, data generation and sampling."""
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec)
    policies: list[PolicySpec] = Field(min_length=1)
    pools: list[PoolSpec] = Field(default_factory=lambda: [PoolSpec()], min_length=1)
    sampling: dict[str, SamplingConfig] = Field(default_factory=dict)
    """Sampling per policy name (missing policies use the defaults)."""
    dataflow: DataflowConfig = Field(default_factory=DataflowConfig)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    source: Path | None = Field(default=None, exclude=True)
    """The file this recipe was read from (set by ``load``)."""

    @model_validator(mode="after")
    def _check_names(self) -> Recipe:
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique, got {names}")
        if set(self.dataflow.policies) != set(names):
            self.dataflow = self.dataflow.model_copy(update={"policies": names})
        pools = [p.name for p in self.pools]
        if self.dataset.pool not in pools:
            raise ValueError(f"dataset.pool {self.dataset.pool!r} is not one of the pools {pools}")
        unknown = set(self.sampling) - set(names)
        if unknown:
            raise ValueError(f"sampling names unknown policies {sorted(unknown)}; policies are {names}")
        return self

    def policy(self, name: str) -> PolicySpec:
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(f"no policy {name!r} in recipe {self.run!r}; have {[p.name for p in self.policies]}")

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool {name!r} in recipe {self.run!r}; have {[p.name for p in self.pools]}")

    def sampling_for(self, policy: str) -> SamplingConfig:
        return self.sampling.get(policy, SamplingConfig())

    def resolve_path(self, path: str) -> Path:
        """A path named in the recipe: relative to the recipe's folder, else to the working dir."""
        p = Path(path)
        if not p.is_absolute() and self.source is not None and (self.source.parent / p).exists():
            return self.source.parent / p
        return p

    def build_policy_model(self, name: str) -> Any:
        """A freshly initialised ``torch.nn.Module`` from policy ``name``'s model config."""
        from astraflow.models import build_model  # torch / transformers: only when a model is built

        return build_model(self.resolve_path(self.policy(name).model))

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> Recipe:
        path = Path(path)
        data = read_yaml_mapping(path, "recipe")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            recipe = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid recipe {path}:\n{exc}") from None
        recipe.source = path.resolve()
        return recipe
