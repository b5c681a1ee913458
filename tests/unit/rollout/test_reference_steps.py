"""The SDE, CPS and ODE steps against an fp64 restatement of flow_grpo's `sde_step_with_logprob`
(flow_grpo/diffusers_patch/sd3_sde_with_logprob.py; Flow-GRPO, Liu et al. 2025, eq. 9 and the CPS
step of Wang & Yu 2025), written here from the formulas, not imported from miles.

Tolerance, derived: fp32's unit roundoff is u = 2^-24 = 5.96e-8. Our step evaluates each quantity
from exact fp32 inputs with at most K = 16 roundings along any path (a few scalar ops on sigma,
sqrt/log/exp, the products and sums over the latents), so |ours - exact| <= K u S, where S is the
quantity's *scale*: the same formula with every term taken by magnitude, plus, where a difference
of two rounded values enters (x_next - mean, s_next^2 - std^2), the sensitivity of the result to
that difference's rounding. K u = 9.5e-7 < 1e-6, so |ours - fp64| <= 1e-6 S holds on any IEEE-754
CPU whatever the order of its reductions; the test computes S in fp64 beside the reference. A
one-symbol change of the formula moves a quantity by O(S), far above 1e-6 S.
"""

import math

import numpy as np
import pytest
import torch

from miles.rollout.sde import largest_sigma_below_one, sde_step

REL = 1e-6
SHIFT, NUM_STEPS = 3.0, 10
STEPS = [0, 3, 6, 9]  # sigma = 1 (step 0), two middle steps, the last step (to sigma 0)
SHAPE = (len(STEPS), 4, 6, 6)  # batch 4


def sd3_sigmas() -> np.ndarray:
    """FlowMatchEulerDiscreteScheduler's SD3 schedule: t = 1 .. 1/N, shifted, then 0 appended."""
    t = np.linspace(1.0, 1.0 / NUM_STEPS, NUM_STEPS)
    shifted = SHIFT * t / (1 + (SHIFT - 1) * t)
    return np.append(shifted, 0.0).astype(np.float32)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    sig = sd3_sigmas()
    x, v, noise = (torch.randn(SHAPE, generator=g) for _ in range(3))
    sigma = torch.tensor([sig[i] for i in STEPS])
    sigma_next = torch.tensor([sig[i + 1] for i in STEPS])
    return x, v, noise, sigma, sigma_next, float(sig[1])


def f64(t):
    return t.detach().double().numpy()


def col(a):
    return np.asarray(a, dtype=np.float64).reshape(-1, 1, 1, 1)


def reference_sde(x, v, s, s_next, a, sigma_max, noise=None, x_next=None):
    """flow_grpo's 'sde' branch in fp64: mean, std, sample, log-prob, and the scales S."""
    s, s_next = col(s), col(s_next)
    dt = s_next - s
    std_dev_t = a * np.sqrt(s / (1 - np.where(s == 1, sigma_max, s)))
    c_x = 1 + std_dev_t**2 / (2 * s) * dt
    c_v = (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    mean = x * c_x + v * c_v
    mean_scale = np.abs(x) * (1 + np.abs(std_dev_t**2 / (2 * s) * dt)) + np.abs(v) * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * np.abs(dt)
    std = std_dev_t * np.sqrt(-dt)
    out = {"mean": (mean, mean_scale), "std": (std, std), "std_dev_t": (std_dev_t, std_dev_t)}
    if noise is not None:
        out["sample"] = (mean + std * noise, mean_scale + np.abs(std * noise))
    if x_next is not None:
        d = x_next - mean
        density = -(d**2) / (2 * std**2) - np.log(std) - np.log(np.sqrt(2 * np.pi))
        scale = d**2 / (2 * std**2) + np.abs(d) * mean_scale / std**2 + np.abs(np.log(std)) + np.log(np.sqrt(2 * np.pi))
        out["log_prob"] = (density.mean(axis=(1, 2, 3)), scale.mean(axis=(1, 2, 3)))
    return out


def reference_cps(x, v, s, s_next, a, noise=None, x_next=None):
    """flow_grpo's 'cps' branch in fp64 (log-prob without its constants)."""
    s, s_next = col(s), col(s_next)
    std = s_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - s * v, x + (1 - s) * v
    root = np.sqrt(s_next**2 - std**2)
    mean = x0_hat * (1 - s_next) + x1_hat * root
    # the root's argument loses digits to cancellation: its rounding moves the root by u s_next^2 / root
    root_sensitivity = np.divide(s_next**2, root, out=np.zeros_like(root), where=root > 0)
    mean_scale = (np.abs(x) + s * np.abs(v)) * (1 - s_next) + (np.abs(x) + (1 - s) * np.abs(v)) * (root + root_sensitivity)
    out = {"mean": (mean, mean_scale), "std": (std * np.ones_like(s), std * np.ones_like(s))}
    if noise is not None:
        out["sample"] = (mean + std * noise, mean_scale + np.abs(std * noise))
    if x_next is not None:
        d = x_next - mean
        out["log_prob"] = ((-(d**2)).mean(axis=(1, 2, 3)), (d**2 + 2 * np.abs(d) * mean_scale).mean(axis=(1, 2, 3)))
    return out


def worst(ours: torch.Tensor, reference) -> float:
    """max |ours - fp64| / S over the elements (the quantity the bound applies to)."""
    value, scale = reference
    ours = f64(ours).reshape(np.shape(value)) if np.ndim(value) else f64(ours)
    scale = np.maximum(np.broadcast_to(scale, np.shape(value)), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(ours - value) / scale))


@pytest.mark.parametrize("noise_level", [0.7, 1.2])
def test_sde_step_equals_flow_grpo_mean_std_sample_and_log_prob(noise_level):
    x, v, noise, sigma, sigma_next, sigma_max = inputs()
    assert sigma_max == largest_sigma_below_one(sd3_sigmas().tolist())
    step = sde_step(x, v, sigma, sigma_next, noise_level, "sde", noise=noise, sigma_max=sigma_max)
    ref = reference_sde(f64(x), f64(v), f64(sigma), f64(sigma_next), noise_level, sigma_max, noise=f64(noise))
    for name, ours in (("mean", step.mean), ("std", step.std), ("std_dev_t", step.std_dev_t), ("sample", step.x_next)):
        assert worst(ours, ref[name]) <= REL, f"{name}: {worst(ours, ref[name]):.3g} S"
    # the log-prob of a stored next state (the trainer's use), given to both sides in fp32
    x_next = step.x_next.clone()
    again = sde_step(x, v, sigma, sigma_next, noise_level, "sde", x_next=x_next, sigma_max=sigma_max)
    ref = reference_sde(f64(x), f64(v), f64(sigma), f64(sigma_next), noise_level, sigma_max, x_next=f64(x_next))
    assert worst(again.log_prob, ref["log_prob"]) <= REL, f"log_prob: {worst(again.log_prob, ref['log_prob']):.3g} S"


@pytest.mark.parametrize("noise_level", [0.7, 1.2])
def test_cps_step_equals_flow_grpo_mean_std_sample_and_log_prob(noise_level):
    x, v, noise, sigma, sigma_next, _ = inputs(1)
    step = sde_step(x, v, sigma, sigma_next, noise_level, "cps", noise=noise)
    ref = reference_cps(f64(x), f64(v), f64(sigma), f64(sigma_next), noise_level, noise=f64(noise))
    for name, ours in (("mean", step.mean), ("std", step.std), ("sample", step.x_next)):
        assert worst(ours, ref[name]) <= REL, f"{name}: {worst(ours, ref[name]):.3g} S"
    again = sde_step(x, v, sigma, sigma_next, noise_level, "cps", x_next=step.x_next.clone())
    ref = reference_cps(f64(x), f64(v), f64(sigma), f64(sigma_next), noise_level, x_next=f64(step.x_next))
    assert worst(again.log_prob, ref["log_prob"]) <= REL, f"log_prob: {worst(again.log_prob, ref['log_prob']):.3g} S"


def test_ode_step_equals_the_euler_step():
    x, v, _, sigma, sigma_next, sigma_max = inputs(2)
    step = sde_step(x, v, sigma, sigma_next, 0.7, "ode", sigma_max=sigma_max)
    dt = col(f64(sigma_next) - f64(sigma))
    ref = (f64(x) + f64(v) * dt, np.abs(f64(x)) + np.abs(f64(v) * dt))
    assert worst(step.mean, ref) <= REL, f"mean: {worst(step.mean, ref):.3g} S"
    assert worst(step.x_next, ref) <= REL, f"sample: {worst(step.x_next, ref):.3g} S"
