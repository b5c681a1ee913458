"""AdamW, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")


# foreach AdamW makes temporaries the size of everything one call updates: SD3.5's whole trained
# transformer at once added 8.2 GiB to the NFT recipe's train phase (python3 -m miles.replay
# scripts/run_diffusion_nft_sd3_pickscore.py: 75.2 GiB against 67.0 with foreach=False, over its
# 72 GiB budget). One parameter group per transformer block bounds them by the largest block, a
# size the block count does not change (the replay extrapolates the step linearly in blocks).


def group_key(name: str) -> str:
    """`transformer.blocks.3.attn.to_q.weight` -> `transformer.blocks.3`: the name up to its first
    numeric part (a block); a parameter outside the blocks keys by its component alone."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def param_groups(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Consecutive parameters with the same `group_key` in one group. Names, not sizes, decide, so
    every rank count groups alike and a sharded checkpoint's optimizer state loads on any of them."""
    groups: list[tuple[str, list[torch.nn.Parameter]]] = []
    for name, p in named:
        key = group_key(name)
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(p)
    return [{"params": ps} for _, ps in groups]


def build_optimizer(params: list, args) -> torch.optim.AdamW:
    """`params`: (name, parameter) pairs, grouped by block (`param_groups`), or bare parameters (one group)."""
    # foreach: a few fused launches per group instead of a dozen per parameter. The update stays
    # elementwise (each element's new value a function of its own weight, gradient and moments,
    # by the same ops in the same order as foreach=False), so how a rank count shards the
    # parameters, or how they are grouped, changes no bit of it (tests/unit/backends/test_optimizer_ema.py).
    named = bool(params) and isinstance(params[0], tuple)
    return torch.optim.AdamW(
        param_groups(params) if named else params,
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
