"""All loss math of the trainer: advantages, Flow-GRPO policy loss, DiffusionNFT, SFT.

Functions here are pure tensor math so they can be checked against hand-computed values; the
train actor (`actor.py`) does the forwards that produce their inputs. Every per-pair quantity
is a [B] tensor over the pairs of one micro-batch; the caller weights each micro-batch's mean by
its share of the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOSS_TYPES = ("policy_loss", "nft", "sft_loss")

# Flow-GRPO's guard against a zero-variance group (every sample scored alike)
ADVANTAGE_STD_EPS = 1e-4


ADVANTAGE_ESTIMATORS = ("grpo",)  # keep in step with --advantage-estimator's choices


def compute_advantages(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    *,
    globalize_mean: bool = False,
    globalize_std: bool = False,
    adv_clip_max: float = 5.0,
    estimator: str = "grpo",
) -> torch.Tensor:
    """GRPO advantages for rewards laid out prompt-major ([prompts * n_samples_per_prompt]).

    `estimator` is --advantage-estimator; GRPO is the one implemented (and the only choice the
    parser offers), anything else is an error here too.

    (reward - mean) / std with the mean and std of the prompt's group, or of the whole batch under
    the globalize flags. One sample per prompt has no group spread, so std normalisation is off.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator {estimator!r} is not implemented; use one of "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    grouped = rewards.float().reshape(-1, n_samples_per_prompt)
    mean = grouped.mean() if globalize_mean else grouped.mean(dim=1, keepdim=True)
    centered = grouped - mean
    if n_samples_per_prompt > 1:
        std = grouped.std(unbiased=False) if globalize_std else grouped.std(dim=1, keepdim=True, unbiased=False)
        centered = centered / (std + ADVANTAGE_STD_EPS)
    return centered.clamp(-adv_clip_max, adv_clip_max).reshape(-1)


@dataclass
class PolicyLossInputs:
    """What the Flow-GRPO loss (or a custom one) sees for one micro-batch of B pairs."""

    log_prob: torch.Tensor  # [B] under the weights being trained
    old_log_prob: torch.Tensor  # [B] recorded by the engine
    advantages: torch.Tensor  # [B] of each pair's sample
    mean: torch.Tensor  # [B, ...] the SDE step's mean under the weights being trained
    std: torch.Tensor  # [B, 1, ...] std of x_next around the mean
    ref_mean: torch.Tensor | None = None  # [B, ...] the mean under the KL reference


def policy_loss(
    inputs: PolicyLossInputs, *, clip_range: float, kl_beta: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO: clipped importance-ratio objective, plus an optional KL to a reference."""
    adv = inputs.advantages.float()
    ratio = torch.exp(inputs.log_prob - inputs.old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = torch.maximum(unclipped, clipped).mean()
    metrics = {
        "pg_loss": pg_loss.detach(),
        "ppo_clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean().detach(),
        "approx_kl": (0.5 * (inputs.log_prob - inputs.old_log_prob) ** 2).mean().detach(),
    }
    loss = pg_loss
    if kl_beta > 0:
        if inputs.ref_mean is None:
            raise ValueError("kl_beta > 0 needs the reference mean")
        kl = gaussian_mean_kl(inputs.mean, inputs.ref_mean, inputs.std)
        metrics["kl_loss"] = kl.detach()
        loss = loss + kl_beta * kl
    return loss, metrics


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians of equal std: (mean - ref)^2 / (2 std^2), averaged per pair then over pairs."""
    dims = tuple(range(1, mean.ndim))
    per_pair = ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * std.reshape(std.shape[0], -1)[:, 0] ** 2)
    return per_pair.mean()


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] from a clamped advantage."""
    return 0.5 + 0.5 * (advantages.float() / adv_clip_max).clamp(-1.0, 1.0)


def nft_loss(
    v_new: torch.Tensor, v_old: torch.Tensor, v_target: torch.Tensor, optimality: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT: regress an implicit positive policy on good samples, a negative one on bad.

    v+ = (1 - beta) v_old + beta v_new and v- = (1 + beta) v_old - beta v_new; the loss is
    r |v+ - target|^2 + (1 - r) |v- - target|^2, each averaged over the non-batch dims.
    """
    dims = tuple(range(1, v_new.ndim))
    v_pos = (1.0 - beta) * v_old + beta * v_new
    v_neg = (1.0 + beta) * v_old - beta * v_new
    pos = ((v_pos - v_target) ** 2).mean(dim=dims)
    neg = ((v_neg - v_target) ** 2).mean(dim=dims)
    r = optimality.float()
    loss = (r * pos + (1.0 - r) * neg).mean()
    return loss, {"nft_pos_loss": pos.mean().detach(), "nft_neg_loss": neg.mean().detach()}


def flow_matching_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity of x_t = (1 - s) x0 + s e, i.e. dx_t/ds."""
    return noise - x0


def sft_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-matching velocity regression: mean |v - (e - x0)|^2."""
    loss = ((v_pred.float() - flow_matching_target(x0.float(), noise.float())) ** 2).mean()
    return loss, {}


CustomLoss = Callable[[object, PolicyLossInputs], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def load_custom_loss(path: str) -> CustomLoss:
    """`pkg.mod:fn` or `pkg.mod.fn`; fn(args, inputs: PolicyLossInputs) -> (loss, metrics)."""
    from miles.utils.dotted_path import load_callable

    return load_callable(path, what="--custom-loss-function-path")
