"""A recipe: everything one RL run needs besides the cluster — model, data, workflow, policies,
rollout pools, dataflow plug-ins and hyper-parameters. YAML, validated here with readable errors.

Each section's fields are documented in the config class that owns them (``DataflowConfig``,
``TorchBackendConfig``, ``HFEngineConfig``, ``SamplingConfig``, ``SFTConfig``). The ``dataset`` and
``workflow`` sections (and the tools, environments and rewards inside a workflow) are plug-ins named
by ``type``: each is parsed into the named plug-in's own typed options when the recipe loads, so an
unknown name, a misspelt option or a wrong type is refused with a message naming the field before
any process starts. ``imports`` names modules that register a user's own plug-ins.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from astraflow.config import ConfigError, read_yaml_mapping
from astraflow.dataflow.config import DataflowConfig
from astraflow.engines import EngineConfig, HFEngineConfig
from astraflow.report.sinks.config import ReportConfig
from astraflow.sft import SFTConfig
from astraflow.tasks import DatasetField
from astraflow.trainer.config import BackendConfig, TorchBackendConfig
from astraflow.workflows import SamplingConfig, WorkflowField


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicySpec(_Section):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    """Policy id: names its batch and weight topics and its bucket prefix."""
    model: str = "examples/models/tiny.yaml"
    """The policy's checkpoint: a Hugging Face checkpoint directory (config.json, safetensors,
    tokenizer files, optional chat template), an ``s3://bucket/prefix`` holding one (downloaded
    once into a local cache), a ``.gguf`` file (converted once), or a tiny-model ``.yaml`` spec
    (materialised once as a checkpoint directory). Relative to the recipe file or the working dir."""
    trust_remote_code: bool = False
    """Let ``transformers`` run code shipped with the checkpoint (off unless you trust it)."""
    backend: BackendConfig = Field(default_factory=TorchBackendConfig)
    """Trainer backend (``type``: torch, simulated, a connector's) and its typed options."""
    sft: SFTConfig | None = None
    """Supervised warm start before RL (``None``: start from the initialised model)."""


class PoolAutoscale(_Section):
    """How ``astraflow run`` follows the dataflow's autoscaling report for one pool (the local
    actuator, :mod:`astraflow.launcher.actuator`): it starts and drains RaaS nodes of the pool
    within ``[min_nodes, max_nodes]``. The report itself is configured by ``dataflow.autoscale``."""

    min_nodes: int = Field(default=1, ge=1)
    """Fewest nodes the launcher keeps running. At least 1: a pool without nodes sends the dataflow
    nothing, so its report could never ask for nodes again."""
    max_nodes: int = Field(ge=1)
    """Most nodes the launcher runs for this pool (nodes joined from elsewhere not counted)."""
    cooldown_s: float = Field(default=60.0, ge=0.0)
    """No change within this many seconds of the previous one (or of the run's start): long enough
    for a started node to join and a stopped one to drain, so that the next report reflects them."""
    confirm_reports: int = Field(default=2, ge=1)
    """Consecutive reports that must ask for a change in the same direction before it is made
    (hysteresis: one noisy report window moves nothing)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolAutoscale:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes {self.min_nodes} > max_nodes {self.max_nodes}")
        return self


class PoolSpec(_Section):
    name: str = Field(default="default", pattern=r"^[a-z][a-z0-9_-]*$")
    """Pool id: names the task topic ``<run>.tasks.<pool>`` and its consumer group."""
    nodes: int = Field(default=1, ge=0)
    """RaaS nodes the launcher starts for this pool (more can join from anywhere); with
    ``autoscale``, the count it starts with."""
    concurrency: int = Field(default=8, ge=1)
    """Episodes a node runs at once."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """Inference engine of the pool's nodes (``type``: hf, simulated, a connector's) and its typed options."""
    drain_timeout_s: float = Field(default=30.0, ge=0.0)
    """On SIGTERM a node takes no new task and finishes its running episodes for up to this long,
    commits them and leaves the consumer group; episodes still running then are handed back
    (not committed: the group delivers them to another node)."""
    autoscale: PoolAutoscale | None = None
    """Let ``astraflow run`` start and stop this pool's nodes from the dataflow's autoscaling report
    (``None``: the launcher keeps ``nodes`` running)."""

    @model_validator(mode="after")
    def _check_autoscale(self) -> PoolSpec:
        a = self.autoscale
        if a is not None and not a.min_nodes <= self.nodes <= a.max_nodes:
            raise ValueError(f"pool {self.name!r}: nodes {self.nodes} is outside autoscale "
                             f"[min_nodes {a.min_nodes}, max_nodes {a.max_nodes}]")
        return self


class TrainerSpec(_Section):
    steps: int = Field(default=40, ge=1)
    """Optimizer steps per policy; the run ends when every trainer reached it."""
    ranks: int = Field(default=1, ge=1)
    """Ranks of each policy's trainer. Above 1 the trainer is a group of processes launched by
    torch.distributed.run (gloo on CPU, NCCL on CUDA, one device per rank), supervised as one
    component; the torch backend shards the model with FSDP2. See ``astraflow.trainer.distributed``."""
    anchor_every: int = Field(default=10, ge=1)
    """A full checkpoint (anchor) every K versions; deltas in between."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Trainer state (model, optimizer, consumed offsets) saved every N steps."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Trainer checkpoints kept in the bucket: after each save the older ones are deleted (once the
    new pointer is written). A resume reads only the newest, and refuses it if corrupt; the others
    are for a human to roll back to (copy a step's ``pointer.json`` over ``latest.json``)."""
    weights_gc_every: int = Field(default=10, ge=0)
    """Garbage-collect the policy's weight versions every N published versions, as
    ``astraflow weights gc`` does with its defaults (keeps the latest anchor and its chain, the 2
    newest versions and every live subscriber's chain; off the training loop). 0: never during the
    run (the bucket then keeps every version until ``astraflow weights gc``)."""
    max_publish_lag: int = Field(default=2, ge=1)
    """The trainer blocks only when more than this many versions wait to be published."""
    publish_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the published (served) weights. The trainer keeps fp32 master weights and fp32
    checkpoints; every published version (v0 included, also the demo's) is a cast of them, as in
    AstraFlow and TRL. bf16 makes each version a sparse delta (an update that does not move a weight
    past a bf16 rounding boundary changes no bit); the small train/serve mismatch is corrected by
    the PPO importance ratio against the behaviour log-probs the nodes record."""
    encode_weights_on: Literal["device", "host"] = "device"
    """Where a trainer whose weights are on a GPU encodes each version: ``device`` keeps the published
    copies on the GPU, where the diff, sparsity scan, gap coding and CRC-32C run, and only the packed
    bytes come to the host (the GPU then holds up to ``max_publish_lag + 2`` bf16 copies of the model);
    ``host`` copies them to CPU memory first (the GPU holds none). A CPU trainer encodes on the host."""


class EvalSpec(_Section):
    prompts: int = Field(default=200, ge=1)
    """Held-out prompts scored (greedy) before and after RL."""


class Recipe(_Section):
    run: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run id (topic and bucket prefix). ``astraflow run --run-id`` overrides it."""
    imports: list[str] = Field(default_factory=list)
    """Python modules imported before the rest is validated: they register a user's own datasets,
    workflows, tools, environments, rewards and dataflow plug-ins by name."""
    seed: int = 0
    """Seed of model initialisation, data generation and sampling."""
    dataset: DatasetField = Field(default_factory=lambda: {"type": "minmax"}, validate_default=True)
    """The dataset plug-in and its options (``type`` names it: minmax, add, jsonl, parquet, ...)."""
    workflow: WorkflowField = Field(default_factory=lambda: {"type": "math"}, validate_default=True)
    """The workflow plug-in and its options (``type`` names it: math, solver_verifier, tool_agent, ...)."""
    policies: list[PolicySpec] = Field(min_length=1)
    pools: list[PoolSpec] = Field(default_factory=lambda: [PoolSpec()], min_length=1)
    sampling: dict[str, SamplingConfig] = Field(default_factory=dict)
    """Sampling per policy name (missing policies use the defaults)."""
    dataflow: DataflowConfig = Field(default_factory=DataflowConfig)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    report: ReportConfig = Field(default_factory=ReportConfig)
    """Metrics sinks fed from ``<run>.metrics`` (TensorBoard); none by default."""
    source: Path | None = Field(default=None, exclude=True)
    """The file this recipe was read from (set by ``load``)."""

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        for module in (data.get("imports") or []) if isinstance(data, dict) else []:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(f"imports: cannot import plug-in module {module!r}: {exc}") from None
        return data

    @model_validator(mode="after")
    def _check_names(self) -> Recipe:
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique, got {names}")
        called = self.workflow.policies()
        missing = [p for p in called if p not in names]
        if missing:
            raise ValueError(f"workflow {self.workflow.type!r} calls policies {missing} that the recipe does "
                             f"not define; policies are {names}")
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

    def role(self, policy: str) -> str:
        """The policy's role in the workflow ("solver", "verifier", "agent", ...)."""
        return self.workflow.roles().get(policy, "solver")

    def localized(self) -> Recipe:
        """The recipe with every local path it names (checkpoints, data files) made absolute
        against its own folder and checked: a missing checkpoint directory, a tokenizer without
        an eos token or a data file without the mapped fields is refused here, naming the field."""
        from astraflow.models import check_model_source

        base = self.source.parent if self.source is not None else None
        policies = []
        for i, p in enumerate(self.policies):
            model = str(self.resolve_path(p.model).resolve()) if _is_local(p.model) else p.model
            try:
                check_model_source(model, base=base)
            except (ConfigError, ValueError) as exc:
                raise ConfigError(f"policies[{i}].model ({p.name}): {exc}") from None
            policies.append(p.model_copy(update={"model": model}))
        try:
            dataset = self.dataset.localized(base)
        except ValueError as exc:
            raise ConfigError(f"dataset.{exc}") from None
        try:
            workflow = self.workflow.localized(base)
        except ValueError as exc:
            raise ConfigError(f"workflow.{exc}") from None
        out = self.model_copy(update={"policies": policies, "dataset": dataset, "workflow": workflow})
        out.source = self.source
        return out

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> Recipe:
        path = Path(path)
        data = read_yaml_mapping(path, "recipe")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_mapping(data, path)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], path: Path) -> Recipe:
        """The recipe in ``data``, read from (or derived from) the file at ``path``: validated, its
        relative paths resolved against ``path``'s folder; a ConfigError naming ``path`` and each bad
        field otherwise."""
        try:
            recipe = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid recipe {path}:\n{_readable(exc)}") from None
        recipe.source = path.resolve()
        try:
            return recipe.localized()
        except ConfigError as exc:
            raise ConfigError(f"invalid recipe {path}: {exc}") from None


def _is_local(source: str) -> bool:
    """A model source that is a path on this machine (not ``s3://...`` or ``scheme:name``)."""
    return "://" not in source and not re.match(r"^[a-z][a-z0-9+.-]*:[^/\\]", source)


def _readable(exc: ValidationError) -> str:
    """One line per problem: the field's dotted path and pydantic's message."""
    lines = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)
