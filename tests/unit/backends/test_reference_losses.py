"""The losses and advantages against fp64 restatements of their references, written here from the
formulas (not imported from miles):

- Flow-GRPO (yifan123/flow_grpo scripts/train_sd3.py): clipped ratio loss, clip fraction, the KL
  mean((mu - mu_ref)^2) / (2 std_dev_t^2); flow_grpo/stat_tracking.py's per-prompt advantages.
- DiffusionNFT (NVlabs/DiffusionNFT scripts/train_nft_sd3.py): the x0-space loss with detached
  adaptive weights, scaled by adv_clip_max / beta, plus beta_kl * mean((v - v_ref)^2).

Tolerance, derived as in tests/unit/rollout/test_reference_steps.py: from exact fp32 inputs our code
rounds at most K = 16 times along any path, so |ours - exact| <= K u S with u = 2^-24 and S the
quantity's scale (its terms by magnitude, plus the sensitivity to each rounded difference that
enters); K u = 9.5e-7 < 1e-6, so |ours - fp64| <= 1e-6 S holds on any IEEE-754 CPU. The clip
fraction is a count: equal exactly (inputs keep every |ratio - 1| at least 1e-3 from the clip range).
"""

import numpy as np
import pytest
import torch

from miles.backends.loss import (
    NFTInputs,
    PolicyLossInputs,
    compute_advantages,
    gaussian_mean_kl,
    nft_loss,
    policy_loss,
)

REL = 1e-6
B = 8


def f64(t):
    return t.detach().double().numpy()


def excess(ours, value, scale) -> float:
    ours = f64(ours) if isinstance(ours, torch.Tensor) else np.float64(ours)
    return float(np.max(np.abs(ours - value) / np.maximum(scale, np.finfo(np.float64).tiny)))


def ratio_inputs(clip_range):
    g = torch.Generator().manual_seed(3)
    delta = torch.rand(B, generator=g) * 4 * clip_range - 2 * clip_range  # ratios inside and outside the clip
    delta = torch.where((delta.abs() - clip_range).abs() < 1e-3 * clip_range, delta * 1.5, delta)
    old = torch.randn(B, generator=g)
    new = old + delta
    adv = torch.randn(B, generator=g) * 2
    return new, old, adv


@pytest.mark.parametrize("clip_range", [1e-4, 0.2])
def test_clipped_policy_loss_and_clip_fraction_equal_flow_grpo(clip_range):
    new, old, adv = ratio_inputs(clip_range)
    mean = torch.zeros(B, 2)
    loss, metrics = policy_loss(PolicyLossInputs(new, old, adv, mean, torch.ones(B, 1)), clip_range=clip_range)
    n, o, a = f64(new), f64(old), f64(adv)
    ratio = np.exp(n - o)
    per = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_range, 1 + clip_range))
    # scale: each term by magnitude; exp's argument n - o is rounded once (relative u (|n| + |o|))
    scale = np.mean(np.abs(a) * ratio * (1 + np.abs(n) + np.abs(o)))
    assert excess(loss, per.mean(), scale) <= REL, f"loss: {excess(loss, per.mean(), scale):.3g} S"
    assert float(metrics["ppo_clipfrac"]) == np.mean(np.abs(ratio - 1) > clip_range)


def test_kl_equals_flow_grpo_over_std_dev_t_squared():
    g = torch.Generator().manual_seed(4)
    mean, ref = torch.randn(B, 4, 5, 5, generator=g), torch.randn(B, 4, 5, 5, generator=g)
    std_dev_t = torch.rand(B, 1, 1, 1, generator=g) + 0.1
    ours = gaussian_mean_kl(mean, ref, std_dev_t)
    m, r, s = f64(mean), f64(ref), f64(std_dev_t)
    value = ((m - r) ** 2).mean(axis=(1, 2, 3), keepdims=True) / (2 * s**2)
    scale = ((m - r) ** 2 + np.abs(m - r) * (np.abs(m) + np.abs(r))).mean(axis=(1, 2, 3), keepdims=True) / (2 * s**2)
    assert excess(ours, value.reshape(-1), scale.reshape(-1)) <= REL, f"kl: {excess(ours, value.reshape(-1), scale.reshape(-1)):.3g} S"


def stat_tracker(prompts, rewards, global_std):
    """flow_grpo's PerPromptStatTracker.update (type 'grpo') in fp64."""
    prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
    out = np.empty_like(rewards)
    for p in np.unique(prompts):
        group = rewards[prompts == p]
        std = (np.std(rewards) if global_std else np.std(group)) + 1e-4
        out[prompts == p] = (group - group.mean()) / std
    scale = np.zeros_like(rewards)
    for p in np.unique(prompts):
        scale[prompts == p] = advantage_scale(rewards[prompts == p], rewards if global_std else rewards[prompts == p],
                                              out[prompts == p])
    return out, scale


def advantage_scale(group, std_of, advantages):
    """(r - mean) is rounded relative to |r| + |mean|; the std, a root of squared such differences,
    relative to (max |r| + |mean|) / std; both divide into the advantage."""
    std = np.std(std_of)
    spread = (np.abs(std_of).max() + abs(std_of.mean())) / std if std > 0 else 0.0
    return (np.abs(group) + abs(group.mean())) / (std + 1e-4) + np.abs(advantages) * (1 + spread)


@pytest.mark.parametrize("global_std", [False, True])
def test_advantages_equal_flow_grpo_per_prompt_stat_tracking(global_std):
    g = torch.Generator().manual_seed(5)
    n = 4
    rewards = torch.rand(3 * n, generator=g)
    rewards[n:2 * n] = rewards[n]  # a flat group: zero advantages
    ours = compute_advantages(rewards, n, globalize_std=global_std, adv_clip_max=1e9)
    value, scale = stat_tracker(np.repeat(["a", "b", "c"], n), f64(rewards), global_std)
    assert excess(ours, value, scale) <= REL, f"advantages: {excess(ours, value, scale):.3g} S"
    assert (ours[n:2 * n] == 0).all()


def test_one_sample_per_prompt_advantages_equal_flow_grpo_batch_normalisation():
    rewards = torch.rand(B, generator=torch.Generator().manual_seed(6))
    ours = compute_advantages(rewards, 1, adv_clip_max=1e9)
    r = f64(rewards)
    value = (r - r.mean()) / (r.std() + 1e-4)
    scale = advantage_scale(r, r, value)
    assert excess(ours, value, scale) <= REL, f"advantages: {excess(ours, value, scale):.3g} S"


def reference_nft(v, v_old, v_ref, x_t, x0, t, adv, beta, clip_max, kl_beta):
    """train_nft_sd3.py's loss in fp64, and its scale."""
    t = t.reshape(-1, 1, 1, 1)
    r = np.clip(np.clip(adv, -clip_max, clip_max) / clip_max / 2 + 0.5, 0, 1)
    terms, scales = [], []
    for v_mix, mag in ((beta * v + (1 - beta) * v_old, beta * np.abs(v) + abs(1 - beta) * np.abs(v_old)),
                       ((1 + beta) * v_old - beta * v, (1 + beta) * np.abs(v_old) + beta * np.abs(v))):
        err = x_t - t * v_mix - x0
        err_scale = np.abs(x_t) + t * mag + np.abs(x0)  # the rounding of err is at most K u of this
        w = np.clip(np.abs(err).mean(axis=(1, 2, 3), keepdims=True), 1e-5, None)
        terms.append((err**2 / w).mean(axis=(1, 2, 3)))
        scales.append(((err**2 + 2 * np.abs(err) * err_scale) / w).mean(axis=(1, 2, 3)))
    policy = (clip_max * (r * terms[0] / beta + (1 - r) * terms[1] / beta)).mean()
    policy_scale = (clip_max * (r * scales[0] + (1 - r) * scales[1]) / beta).mean()
    kl = ((v - v_ref) ** 2).mean(axis=(1, 2, 3)).mean()
    kl_scale = ((v - v_ref) ** 2 + 2 * np.abs(v - v_ref) * (np.abs(v) + np.abs(v_ref))).mean()
    return policy + kl_beta * kl, policy_scale + kl_beta * kl_scale


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 1e-4), (0.1, 0.1)])
def test_nft_loss_equals_diffusion_nft(beta, kl_beta):
    g = torch.Generator().manual_seed(7)
    shape = (B, 4, 5, 5)
    x0, noise, v, v_old, v_ref = (torch.randn(shape, generator=g) for _ in range(5))
    t = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05])
    x_t = (1 - t.reshape(-1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1) * noise
    adv = torch.randn(B, generator=g) * 4
    loss, _ = nft_loss(NFTInputs(v, v_old, x_t, x0, t, adv, v_ref), beta=beta, adv_clip_max=5.0, kl_beta=kl_beta)
    value, scale = reference_nft(f64(v), f64(v_old), f64(v_ref), f64(x_t), f64(x0), f64(t), f64(adv), beta, 5.0,
                                 kl_beta)
    assert excess(loss, value, scale) <= REL, f"nft: {excess(loss, value, scale):.3g} S"


def reference_return_decay(step, flat, uprate, uphold):
    """train_nft_sd3.py's return_decay for one decay_type's (flat, uprate, uphold)."""
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


@pytest.mark.parametrize("flat, uprate, uphold", [(0, 0.0, 0.0), (0, 0.001, 0.5), (75, 0.0075, 0.999)])
def test_old_policy_decay_equals_diffusion_nft_return_decay(flat, uprate, uphold):
    from miles.backends.ema import old_policy_decay

    for step in (0, 1, 2, 74, 75, 76, 200, 499, 500, 501, 10_000):
        ours = old_policy_decay(step, init=0.0, ramp=uprate, maximum=uphold, flat_steps=flat)
        assert ours == reference_return_decay(step, flat, uprate, uphold), step
