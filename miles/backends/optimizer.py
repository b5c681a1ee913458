"""AdamW, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def build_optimizer(params: list[torch.nn.Parameter], args) -> torch.optim.AdamW:
    # foreach: a few fused launches per step instead of a dozen per parameter. The update stays
    # elementwise (each element's new value a function of its own weight, gradient and moments,
    # by the same ops in the same order as foreach=False), so how a rank count shards the
    # parameters changes no bit of it (tests/unit/backends/test_optimizer_ema.py compares).
    return torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        foreach=True,
    )


def learning_rate(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int | None, decay_style: str
) -> float:
    """The LR for optimizer step `step` (0-based): linear warmup, then decay to min_lr at total_steps."""
    if decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"unknown --lr-decay-style {decay_style!r}; choose one of {', '.join(LR_DECAY_STYLES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_style == "constant" or not total_steps or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay_style == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def run_rollouts(args) -> int:
    """Rollouts the run makes: --num-rollout, or --num-epoch passes over the prompt data (the driver's
    count: batches of --rollout-batch-size that cover the items, the last one spilling over)."""
    if args.num_rollout:
        return args.num_rollout
    if args.loss_type == "sft_loss":
        from miles.backends.sft_data import SFTDataset

        dataset = SFTDataset.from_args(args)
    else:
        from miles.rollout.data import PromptDataset

        dataset = PromptDataset.from_args(args)
    return args.num_epoch * dataset.batches_per_epoch(args.rollout_batch_size)


def decay_steps(args, steps_per_rollout: int) -> int:
    """Optimizer steps the LR schedule spans: every optimizer step of the run."""
    return run_rollouts(args) * steps_per_rollout


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip in place; returns the total norm before clipping, a 0-dim tensor on the device (read
    with the step's metrics). max_norm <= 0 only measures."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
