"""Settings of the SIMULATED trainer backend (``backend.type: simulated``); a module of its own so
that ``BackendConfig`` can name it without importing the backend."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SimulatedBackendConfig(BaseModel):
    """Step-time model and published tensors of the simulated trainer backend."""

    model_config = ConfigDict(extra="forbid")

    step_base_s: float = Field(default=0.2, ge=0)
    """Fixed seconds per step (optimizer, collectives)."""
    step_s_per_token: float = Field(default=2e-4, ge=0)
    """Seconds per trained (loss-masked) token: the step time scales with batch tokens."""
    params: int = Field(default=65_536, ge=1)
    """Parameters of the one published tensor (bf16): small, real, changed every step."""
    changed_fraction: float = Field(default=0.01, gt=0, le=1)
    """Fraction of parameters changed per step (real RL steps change ~0.5-1.5% of bf16 weights)."""
    seed: int = 0
    """Seed of the initial tensor and of which entries change."""
