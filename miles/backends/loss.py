"""All loss math of the trainer: advantages, Flow-GRPO policy loss, DiffusionNFT, SFT.

Functions here are pure tensor math so they can be checked against hand-computed values; the
train step (`train_step.py`) does the forwards that produce their inputs. Every per-pair quantity
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

    (reward - mean) / (std + 1e-4) with the mean and (population) std of the prompt's group, or of
    the whole batch under the globalize flags, as flow_grpo's PerPromptStatTracker. One sample per
    prompt has no group: mean and std are the batch's, as flow_grpo's untracked branch computes them.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator {estimator!r} is not implemented; use one of "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    grouped = rewards.float().reshape(-1, n_samples_per_prompt)
    batch_wide = n_samples_per_prompt == 1
    mean = grouped.mean() if globalize_mean or batch_wide else grouped.mean(dim=1, keepdim=True)
    std_global = globalize_std or batch_wide
    std = grouped.std(unbiased=False) if std_global else grouped.std(dim=1, keepdim=True, unbiased=False)
    advantages = (grouped - mean) / (std + ADVANTAGE_STD_EPS)
    return advantages.clamp(-adv_clip_max, adv_clip_max).reshape(-1)


def trained_pairs_mask(advantages: torch.Tensor, keep_zero_advantage: bool) -> torch.Tensor:
    """Which pairs enter the policy loss: flow_grpo drops every sample whose advantage is exactly 0
    (a flat group; or a sample scored exactly at its group's mean) before training."""
    if keep_zero_advantage:
        return torch.ones_like(advantages, dtype=torch.bool)
    return advantages != 0


@dataclass
class PolicyLossInputs:
    """What the Flow-GRPO loss (or a custom one) sees for one micro-batch of B pairs."""

    log_prob: torch.Tensor  # [B] under the weights being trained
    old_log_prob: torch.Tensor  # [B] recorded by the engine
    advantages: torch.Tensor  # [B] of each pair's sample
    mean: torch.Tensor  # [B, ...] the SDE step's mean under the weights being trained
    std: torch.Tensor  # [B, 1, ...] std of x_next around the mean
    ref_mean: torch.Tensor | None = None  # [B, ...] the mean under the KL reference
    std_dev_t: torch.Tensor | None = None  # [B, 1, ...] the reference's std_dev_t (sde: a*sqrt(s/(1-s)))
    keep: torch.Tensor | None = None  # [B] bool, the pairs the loss averages over; None: all


def policy_loss(
    inputs: PolicyLossInputs, *, clip_range: float, kl_beta: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO: clipped importance-ratio objective, plus an optional KL to a reference.

    Averaged over the kept pairs (`inputs.keep`); a micro-batch with none kept gives a zero loss that
    still carries the graph, so backward runs the same on every rank.
    """
    adv = inputs.advantages.float()
    keep = torch.ones_like(adv, dtype=torch.bool) if inputs.keep is None else inputs.keep.to(adv.device)
    ratio = torch.exp(inputs.log_prob - inputs.old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_pair = torch.maximum(unclipped, clipped)
    pg_loss = kept_mean(per_pair, keep)
    metrics = {
        "pg_loss": pg_loss.detach(),
        "ppo_clipfrac": kept_mean(((ratio - 1.0).abs() > clip_range).float(), keep).detach(),
        "approx_kl": kept_mean(0.5 * (inputs.log_prob - inputs.old_log_prob) ** 2, keep).detach(),
    }
    loss = pg_loss
    if kl_beta > 0:
        if inputs.ref_mean is None or inputs.std_dev_t is None:
            raise ValueError("kl_beta > 0 needs the reference mean and the step's std_dev_t")
        kl = kept_mean(gaussian_mean_kl(inputs.mean, inputs.ref_mean, inputs.std_dev_t), keep)
        metrics["kl_loss"] = kl.detach()
        loss = loss + kl_beta * kl
    return loss, metrics


def kept_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of values[keep]; 0 (with values' graph) when nothing is kept."""
    kept = keep.sum()
    if int(kept) == 0:
        return (values * 0.0).sum()
    return torch.where(keep, values, torch.zeros_like(values)).sum() / kept


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor) -> torch.Tensor:
    """[B] flow_grpo's KL term: mean over non-batch dims of (mean - ref)^2, over 2 std_dev_t^2.

    std_dev_t is the SDE's a*sqrt(s/(1-s)), not the step's std a*sqrt(s/(1-s))*sqrt(-dt): this is the
    reference's definition (its copy of beta = 0.04 means the same here), not the exact KL of the step.
    """
    dims = tuple(range(1, mean.ndim))
    return ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * std_dev_t.reshape(std_dev_t.shape[0], -1)[:, 0] ** 2)


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] from a clamped advantage."""
    return 0.5 + 0.5 * (advantages.float() / adv_clip_max).clamp(-1.0, 1.0)


# DiffusionNFT's floor of the adaptive weight (train_nft_sd3.py)
NFT_WEIGHT_FLOOR = 1e-5


@dataclass
class NFTInputs:
    """One micro-batch of B renoised samples x_t = (1 - t) x0 + t e for DiffusionNFT."""

    v_new: torch.Tensor  # [B, ...] velocity under the weights being trained
    v_old: torch.Tensor  # [B, ...] velocity under the sampling ("old") policy, no gradient
    x_t: torch.Tensor  # [B, ...]
    x0: torch.Tensor  # [B, ...] the rollout's clean sample
    sigma: torch.Tensor  # [B] the t of x_t
    advantages: torch.Tensor  # [B]
    v_ref: torch.Tensor | None = None  # [B, ...] velocity under the KL reference


def nft_loss(inputs: NFTInputs, *, beta: float, adv_clip_max: float, adaptive_weight: bool = True,
             kl_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT (train_nft_sd3.py): the implicit positive and negative policies
    v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v regressed in x0 space,
    x0_hat = x_t - t v, each term divided by a detached per-sample weight mean|x0_hat - x0|; the loss is
    adv_clip_max * mean(r |x0+ - x0|^2 / w+ + (1 - r) |x0- - x0|^2 / w-) / beta
    plus kl_beta * mean |v - v_ref|^2.
    """
    dims = tuple(range(1, inputs.v_new.ndim))
    v_new, v_old = inputs.v_new.float(), inputs.v_old.float().detach()
    x_t, x0 = inputs.x_t.float(), inputs.x0.float()
    t = inputs.sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    r = nft_optimality(inputs.advantages, adv_clip_max).to(v_new.device)
    pos = _x0_regression(x_t - t * (beta * v_new + (1.0 - beta) * v_old), x0, dims, adaptive_weight)
    neg = _x0_regression(x_t - t * ((1.0 + beta) * v_old - beta * v_new), x0, dims, adaptive_weight)
    policy = (adv_clip_max * (r * pos / beta + (1.0 - r) * neg / beta)).mean()
    metrics = {"nft_policy_loss": policy.detach(), "nft_pos_loss": pos.mean().detach(),
               "nft_neg_loss": neg.mean().detach()}
    loss = policy
    if kl_beta > 0:
        if inputs.v_ref is None:
            raise ValueError("kl_beta > 0 needs the reference velocity")
        kl = ((v_new - inputs.v_ref.float()) ** 2).mean(dim=dims).mean()
        metrics["kl_loss"] = kl.detach()
        loss = loss + kl_beta * kl
    return loss, metrics


def _x0_regression(x0_hat: torch.Tensor, x0: torch.Tensor, dims: tuple, adaptive_weight: bool) -> torch.Tensor:
    """[B] mean |x0_hat - x0|^2 over the non-batch dims, divided by the detached mean |x0_hat - x0|."""
    squared = (x0_hat - x0) ** 2
    if adaptive_weight:
        with torch.no_grad():  # fp64 like the reference; a weight, not a gradient path
            weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=NFT_WEIGHT_FLOOR)
        squared = squared / weight.to(squared.dtype)
    return squared.mean(dim=dims)


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
