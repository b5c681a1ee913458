"""The flow-matching sigma schedule, torch-free so the validator can place Wan2.2 steps.

sigma runs from 1 (pure noise) to 0 (data) over `num_steps` steps; step k goes from sigmas[k]
to sigmas[k + 1]. The shift bends the schedule toward high noise, as diffusers'
FlowMatchEulerDiscreteScheduler does.
"""

from __future__ import annotations

NUM_TRAIN_TIMESTEPS = 1000


def shift_sigma(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sigma_schedule(num_steps: int, shift: float) -> list[float]:
    """num_steps + 1 sigmas, from 1.0 down to exactly 0.0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    raw = [1.0 - k / num_steps for k in range(num_steps)]
    return [shift_sigma(s, shift) for s in raw] + [0.0]


def expert_index_for_step(sigmas: list[float], step: int, boundary_ratio: float | None) -> int:
    """0 for the high-noise expert (t >= boundary), 1 for the low-noise one; 0 without a boundary."""
    if boundary_ratio is None:
        return 0
    timestep = sigmas[step] * NUM_TRAIN_TIMESTEPS
    return 0 if timestep >= boundary_ratio * NUM_TRAIN_TIMESTEPS else 1
