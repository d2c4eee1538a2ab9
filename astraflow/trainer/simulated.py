"""A SIMULATED trainer backend for scale experiments on small machines (no gradient is computed).

``step`` sleeps for ``step_base_s + step_s_per_token x batch tokens`` (loss-masked response tokens),
so a batch of long-tail responses costs what it would cost a real trainer proportionally. The
weights are real: one small bf16 tensor (``params`` entries) of which ``changed_fraction`` entries
change every step, so the trainer service publishes real anchors and sparse deltas through the
weight plane and nodes pull and load them: publish and refresh lag are real, not simulated.
Options: :class:`~astraflow.trainer.backend.SimulatedBackendConfig` (``backend.type: simulated``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.config import SimulatedBackendConfig

if TYPE_CHECKING:
    from astraflow.records import Trajectory


class SimulatedBackend(TrainerBackend):
    """Step-time simulator with real, small published tensors; see the module docstring."""

    def __init__(self, config: SimulatedBackendConfig | dict[str, Any] | None = None) -> None:
        import torch

        self.config = config if isinstance(config, SimulatedBackendConfig) else \
            SimulatedBackendConfig.model_validate(config or {})
        self._gen = torch.Generator().manual_seed(self.config.seed)
        self.weight = torch.randn(self.config.params, generator=self._gen).to(torch.bfloat16)
        self.steps = 0

    def step_seconds(self, tokens: int) -> float:
        """Simulated duration of a step on ``tokens`` trained tokens."""
        return self.config.step_base_s + self.config.step_s_per_token * tokens

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        import torch

        if not trajectories:
            raise ValueError("empty batch")
        t0 = time.perf_counter()
        tokens = int(sum(sum(t.loss_mask) for t in trajectories))
        n = self.config.params
        k = max(1, int(n * self.config.changed_fraction))
        idx = torch.randperm(n, generator=self._gen)[:k]
        self.weight[idx] = (self.weight[idx].float() + 1e-2 * torch.randn(k, generator=self._gen)).to(torch.bfloat16)
        time.sleep(max(0.0, self.step_seconds(tokens) - (time.perf_counter() - t0)))
        self.steps += 1
        rewards = [float(t.reward) for t in trajectories]
        return {"loss": 0.0, "grad_norm": 0.0, "reward_mean": sum(rewards) / len(rewards),
                "trajectories": float(len(trajectories)), "tokens": float(tokens),
                "step_seconds": time.perf_counter() - t0}

    def state_dict(self) -> dict[str, Any]:
        return {"simulated.weight": self.weight.clone()}

    def optimizer_state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        if set(model_state) != {"simulated.weight"}:
            raise ValueError(f"not a simulated-backend state: tensors {sorted(model_state)[:5]}")
        self.weight = model_state["simulated.weight"].to("cpu").clone()
        if optimizer_state:
            self.steps = int(optimizer_state.get("steps", 0))
