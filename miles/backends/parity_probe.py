"""What a train step records for the parity standard: which micro-batches of a rollout the probe
checks (`--diffusion-debug-probe-micro-batches`) and the train-side model outputs against the
engine's, on the weights that made the rollout (miles.backends.actor's train step fills it)."""

from __future__ import annotations

import torch

from miles.flags.batching import Pair


def probe_limit(args) -> int:
    """Micro-batches of a rollout the parity probe checks (0: every one). Unset, the CPU tier
    checks every one and a GPU run one (benchmarks/bench_parity_probe.py: its cost)."""
    limit = getattr(args, "diffusion_debug_probe_micro_batches", None)
    if limit is None:
        return 0 if getattr(args, "device", "cpu") == "cpu" else 1
    return limit


def probed_extra_micro_batches(schedule: list[list[list[Pair]]], limit: int,
                               first_window_free: bool = True) -> list[list[Pair]]:
    """The micro-batches the parity probe re-runs as extra no-grad forwards on the rollout's
    weights. `limit` (--diffusion-debug-probe-micro-batches) is how many micro-batches of a rollout
    the probe checks, 0 every one. With `first_window_free` the first optimizer step's micro-batches
    are checked by their own training forward (they run anyway), so only later ones are re-run, for
    what that step lacks; NFT trains on renoised samples, so every checked micro-batch is re-run.
    The same positions on every rank, so sharded ranks all-gather alike."""
    free = len(schedule[0]) if first_window_free else 0
    extra = [mb for window in schedule[1 if first_window_free else 0:] for mb in window]
    return extra[:max(0, limit - free)] if limit else extra


def probed_micro_batches(schedule: list[list[list[Pair]]], limit: int, nft: bool) -> list[list[Pair]]:
    """Every micro-batch `_train_rollout` hands the probe, in its order: the extra forwards first,
    then (policy loss) the first optimizer step's training forwards while the probe wants more."""
    extra = probed_extra_micro_batches(schedule, limit, first_window_free=not nft)
    if nft:
        return extra
    first = schedule[0] if schedule else []
    return extra + (first[:max(0, limit - len(extra))] if limit else first)


class _ParityProbe:
    """Train-side model outputs against the engine's, on the weights that made the rollout."""

    def __init__(self, limit: int = 0):
        self.abs_sum, self.abs_max, self.count, self.log_prob_max = 0.0, 0.0, 0, 0.0
        self.limit, self.micro_batches = limit, 0  # limit 0: every micro-batch

    def wants(self) -> bool:
        return not self.limit or self.micro_batches < self.limit

    def add(self, v: torch.Tensor, stored: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> None:
        diff = (v.float() - stored.float()).abs()
        self.abs_sum += float(diff.sum(dtype=torch.float64))
        self.abs_max = max(self.abs_max, float(diff.max()))
        self.count += diff.numel()
        self.log_prob_max = max(self.log_prob_max, float((log_prob - old_log_prob).abs().max()))
        self.micro_batches += 1
