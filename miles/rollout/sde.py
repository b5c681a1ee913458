"""One denoising step of the flow-matching sampler and its log-probability (DESIGN section 5).

This is the only copy of the step math: the sampler calls it to move forward, the trainer calls
it with `x_next=` to recompute the log-prob of a stored step under new weights.

Conventions: `x_t = (1 - s) x0 + s e`, the model predicts the velocity `v`, and a step goes from
`sigma` to `sigma_next < sigma` (`dt = sigma_next - sigma < 0`). Everything is computed in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SDE_TYPES = ("sde", "ode", "cps")


@dataclass
class StepResult:
    x_next: torch.Tensor  # [B, ...]
    mean: torch.Tensor  # [B, ...] mean of the step's Gaussian
    std: torch.Tensor  # [B, 1, ...] standard deviation of x_next around `mean` (0 for ode)
    log_prob: torch.Tensor  # [B] log-density of x_next, averaged over the non-batch dims
    # [B, 1, ...] the reference's `std_dev_t`: sde a*sqrt(s/(1-s)) (std without sqrt(-dt)), cps the step's
    # std, ode the sde value; the KL divides by its square (docs/algorithms.md, KL)
    std_dev_t: torch.Tensor | None = None


def largest_sigma_below_one(sigmas) -> float:
    """The value that replaces s == 1 in the SDE std's denominator (keeps it finite)."""
    below = [float(s) for s in sigmas if float(s) < 1.0]
    if not below:
        raise ValueError("the schedule has no sigma below 1")
    return max(below)


def _per_sample(value, x: torch.Tensor) -> torch.Tensor:
    """A float or [B] tensor as fp32 [B, 1, 1, ...] broadcastable against x."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(x.shape[0], *([1] * (x.ndim - 1)))


def _mean_over_non_batch(t: torch.Tensor) -> torch.Tensor:
    # One reduction per sample, never one over the batch: a batched reduction may pick its order
    # from the whole tensor's shape, and the engine's sampling batch and a train micro-batch differ
    # in size; a row reduced alone is reduced the same way at any batch size (test_sde checks both).
    return torch.stack([row.mean() for row in t.reshape(t.shape[0], -1)])


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    sde_type: str,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    *,
    sigma_max: float | None = None,
) -> StepResult:
    """Step x from sigma to sigma_next with velocity v.

    `noise` is the standard normal draw (drawn here if None); `x_next`, when given, is a stored
    next state whose log-prob is wanted, and is returned unchanged. `sigma_max` is the largest
    sigma < 1 of the schedule (see `largest_sigma_below_one`); the sde type needs it whenever
    sigma == 1, which is step 0 of every schedule.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; choose one of {', '.join(SDE_TYPES)}")
    x = x.float()
    v = v.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s

    if sde_type == "ode":
        mean = _euler(x, v, dt)
        std = torch.zeros_like(s)
        out = mean if x_next is None else x_next.float()
        std_t = _sde_std_dev_t(s, noise_level, sigma_max) if sigma_max is not None or bool((s < 1.0).all()) else None
        return StepResult(out, mean, std, torch.zeros(x.shape[0], device=x.device), std_t)

    if sde_type == "sde":
        std_t = _sde_std_dev_t(s, noise_level, sigma_max)
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
    else:  # cps: coefficients-preserving sampling, std from sigma_next
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_pred = x - s * v
        noise_pred = x + (1 - s) * v
        mean = x0_pred * (1 - s_next) + noise_pred * torch.sqrt(s_next**2 - std**2)
        std_t = std

    if x_next is None:
        if noise is None:
            noise = torch.randn_like(x)
        x_next = mean + std * noise.float()
    else:
        x_next = x_next.float()

    # the sample is data, not a function of the weights: only the mean carries gradient
    diff = x_next.detach() - mean
    if sde_type == "sde":
        log_density = -(diff**2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    else:
        log_density = -(diff**2)
    return StepResult(x_next, mean, std, _mean_over_non_batch(log_density), std_t)


def _euler(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    return x + v * dt


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The next state of an ode step nobody records (no log-prob, no std): `sde_step(..., "ode")`'s
    x_next bit for bit (the same fp32 dt, one elementwise multiply and add per element), at a fifth
    of its cost, which the sampler pays at every untrained step."""
    dt = torch.tensor(sigma_next, dtype=torch.float32) - torch.tensor(sigma, dtype=torch.float32)
    return _euler(x.float(), v.float(), dt.to(x.device))


def _sde_std_dev_t(s: torch.Tensor, noise_level: float, sigma_max: float | None) -> torch.Tensor:
    """a * sqrt(s / (1 - s)), with s == 1 replaced by sigma_max in the denominator."""
    if bool((s >= 1.0).any()):
        if sigma_max is None:
            raise ValueError("sde_step at sigma == 1 needs sigma_max (the largest sigma < 1 of the schedule)")
        denominator = 1.0 - torch.where(s >= 1.0, torch.full_like(s, sigma_max), s)
    else:
        denominator = 1.0 - s
    return noise_level * torch.sqrt(s / denominator)


def sde_step_on_host(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float, sde_type: str,
                     noise: torch.Tensor | None = None, x_next: torch.Tensor | None = None, *,
                     sigma_max: float | None = None) -> StepResult:
    """`sde_step` computed on the CPU, its results returned on v's device.

    The sampler and the trainer both step through here. The engine draws its noise on the CPU and
    steps there; the trainer's model output lives on the GPU. The same elementwise math (sqrt, log,
    divisions) rounds differently on a GPU, so a trainer stepping on the GPU recomputed each stored
    step's log-prob 1e-7 away from the engine's with identical model outputs (seen on an H200).
    Stepping on one device makes parity exact; the step is cheap next to the model.
    """
    def host(t):
        return t.cpu() if isinstance(t, torch.Tensor) else t

    step = sde_step(host(x), host(v), host(sigma), host(sigma_next), noise_level, sde_type, noise=host(noise),
                    x_next=host(x_next), sigma_max=sigma_max)
    if v.device.type == "cpu":
        return step
    return StepResult(*(None if t is None else t.to(v.device)
                        for t in (step.x_next, step.mean, step.std, step.log_prob, step.std_dev_t)))
