"""Which train pairs each rank trains, in which optimizer step and which forward. Torch-free.

A sample is a whole denoising trajectory; a train pair is one `(sample, step)` transition of it.
The validator builds the batch plan from these functions and the trainer walks the same functions
to pick its pairs, so what the plan promises is what gets trained:

    pairs = expand_pairs(plan.samples_per_rollout, trained_steps)
    shard = shard_pairs(pairs, plan.dp_size, dp_rank, plan.dp_split_mode)
    for window in split_steps(shard, plan.num_steps_per_rollout):   # one optimizer step each
        for micro_batch in micro_batches(window, plan):             # one forward each
            ...

A forward's last bits depend on its batch, so where the pairs come from rollouts each forward must
be exactly one the engine ran: the samples of one microgroup (`--rollout-microgroup-size`
consecutive samples of one prompt), all of them and in order, at one step (`rollout_tile_mismatch`;
the validator refuses a layout with any other forward). That is what keeps the parity probe at
exactly 0.0 and the first step's ratio at exactly 1.

`dp_rank` is the data-parallel rank: sequence-parallel ranks of one DP group share a shard.
`trained_steps` is the ascending list of denoising-step indices the step strategy chose for this
rollout; every sample of the rollout trains the same steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

SPLIT_MODES = ("contiguous", "stride")
ITER_ORDERS = ("sample-major", "timestep-major")


class BatchLayoutError(ValueError):
    """The pairs cannot be dealt, windowed or tiled the way the knobs ask."""


class Pair(NamedTuple):
    sample: int
    step: int


@dataclass(frozen=True)
class MicroBatchSpec:
    """Flat `size` consecutive pairs per forward, or a 2D tile of `tile_samples` x `tile_steps`."""

    size: int = 1
    tile_samples: int | None = None
    tile_steps: int | None = None
    iter_order: str = "sample-major"

    @property
    def is_2d(self) -> bool:
        return self.tile_samples is not None

    @property
    def pairs_per_forward(self) -> int:
        if self.is_2d:
            return self.tile_samples * self.tile_steps
        return self.size

    def describe(self) -> str:
        if self.is_2d:
            return (f"2D tile {self.tile_samples} samples x {self.tile_steps} timesteps, "
                    f"visited {self.iter_order}")
        return f"flat, {self.size} consecutive pairs"


def expand_pairs(num_samples: int, trained_steps: Sequence[int]) -> list[Pair]:
    """Every (sample, step) pair of a rollout, sample-major."""
    return [Pair(sample, step) for sample in range(num_samples) for step in trained_steps]


def shard_pairs(pairs: Sequence[Pair], dp_size: int, rank: int, mode: str) -> list[Pair]:
    """The pairs DP rank `rank` trains; every rank gets the same number or this raises."""
    if not 0 <= rank < dp_size:
        raise BatchLayoutError(f"rank={rank} outside dp_size={dp_size}")
    if len(pairs) % dp_size:
        raise BatchLayoutError(
            f"train pairs={len(pairs)} do not deal evenly to dp_size={dp_size} ranks"
        )
    if mode == "contiguous":
        per_rank = len(pairs) // dp_size
        return list(pairs[rank * per_rank:(rank + 1) * per_rank])
    if mode == "stride":
        return list(pairs[rank::dp_size])
    raise BatchLayoutError(f"unknown dp split mode {mode!r}; choose one of {', '.join(SPLIT_MODES)}")


def split_steps(shard: Sequence[Pair], num_steps_per_rollout: int) -> list[list[Pair]]:
    """Cut a rank's shard into `num_steps_per_rollout` equal, consecutive optimizer-step windows."""
    if len(shard) % num_steps_per_rollout:
        raise BatchLayoutError(
            f"num_pairs_shard={len(shard)} not divisible by "
            f"num_steps_per_rollout={num_steps_per_rollout}"
        )
    per_step = len(shard) // num_steps_per_rollout
    return [list(shard[i * per_step:(i + 1) * per_step]) for i in range(num_steps_per_rollout)]


def micro_batches(window: Sequence[Pair], plan: "BatchPlan | MicroBatchSpec") -> list[list[Pair]]:
    """Tile one optimizer-step window into the pair lists of its forwards."""
    spec = plan.micro_batching if isinstance(plan, BatchPlan) else plan
    if spec.is_2d:
        return _tile_2d(window, spec)
    return _chunk_flat(window, spec.size)


def _chunk_flat(window: Sequence[Pair], size: int) -> list[list[Pair]]:
    if len(window) % size:
        raise BatchLayoutError(
            f"pairs per optimizer step per rank={len(window)} not divisible by micro_batch_size={size}"
        )
    return [list(window[i:i + size]) for i in range(0, len(window), size)]


def rollout_tile_mismatch(forward: Sequence[Pair], microgroup_size: int) -> str | None:
    """Why a forward's pairs are not one engine forward (the `microgroup_size` samples of one
    microgroup, ascending, at one step), or None when they are. Samples are numbered prompt-major
    and microgroups cut each prompt's samples in order, so microgroup k is samples kM .. kM + M - 1."""
    steps = sorted({pair.step for pair in forward})
    if len(steps) != 1:
        return f"a forward would hold {len(steps)} timesteps"
    samples = [pair.sample for pair in forward]
    first = samples[0] - samples[0] % microgroup_size
    if samples != list(range(first, first + microgroup_size)):
        shown = samples if len(samples) <= 4 else samples[:3] + ["..."]
        return (f"a forward would hold samples {shown}, not microgroup {first // microgroup_size}'s "
                f"{microgroup_size} samples {first}..{first + microgroup_size - 1}")
    return None


def window_grid(window: Sequence[Pair]) -> tuple[list[int], list[int]]:
    """The window's samples (first-seen order) and steps (ascending) if it is a full grid."""
    samples = list(dict.fromkeys(pair.sample for pair in window))
    steps = sorted({pair.step for pair in window})
    if len(samples) * len(steps) != len(window) or len(set(window)) != len(window):
        raise BatchLayoutError(
            f"an optimizer-step window of {len(window)} pairs is not a full samples x timesteps "
            f"grid ({len(samples)} samples, {len(steps)} timesteps), so it cannot be tiled in 2D"
        )
    return samples, steps


def _tile_2d(window: Sequence[Pair], spec: MicroBatchSpec) -> list[list[Pair]]:
    samples, steps = window_grid(window)
    if len(samples) % spec.tile_samples or len(steps) % spec.tile_steps:
        raise BatchLayoutError(
            f"an optimizer-step window of {len(samples)} samples x {len(steps)} timesteps does not "
            f"tile into {spec.tile_samples} x {spec.tile_steps} micro-batches"
        )
    sample_blocks = _blocks(samples, spec.tile_samples)
    step_blocks = _blocks(steps, spec.tile_steps)
    if spec.iter_order == "timestep-major":
        order = [(s, t) for t in step_blocks for s in sample_blocks]
    else:
        order = [(s, t) for s in sample_blocks for t in step_blocks]
    return [[Pair(sample, step) for sample in s for step in t] for s, t in order]


def _blocks(items: list[int], size: int) -> list[list[int]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def rank_schedule(plan: "BatchPlan", trained_steps: Sequence[int], dp_rank: int) -> list[list[list[Pair]]]:
    """For one DP rank: optimizer steps -> forwards -> pairs, exactly as the plan counts them."""
    if len(trained_steps) != plan.num_trained_steps:
        raise BatchLayoutError(
            f"the step strategy chose {len(trained_steps)} steps but the plan trains "
            f"{plan.num_trained_steps} per sample"
        )
    pairs = expand_pairs(plan.samples_per_rollout, trained_steps)
    shard = shard_pairs(pairs, plan.dp_size, dp_rank, plan.dp_split_mode)
    return [micro_batches(window, plan) for window in split_steps(shard, plan.num_steps_per_rollout)]


@dataclass(frozen=True)
class BatchPlan:
    """How the batch knobs turn into samples, pairs and forwards for every rollout."""

    family: str
    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout: int
    global_batch_size: int
    num_steps_per_rollout: int
    num_denoising_steps: int
    num_trained_steps: int
    train_pairs: int
    dp_size: int
    dp_split_mode: str
    pairs_per_rank: int
    pairs_per_step_per_rank: int
    micro_batching: MicroBatchSpec
    forwards_per_step: int
    step_strategy: str
    trainable_steps: tuple[int, ...]  # every step some allowed strategy choice can train
    sigmas: tuple[float, ...] = ()
    experts: tuple[str, ...] = ()  # expert component per denoising step; () with one expert
    rollout_tile_samples: int = 0  # samples of the engines' forwards every forward reproduces; 0: no rollouts (SFT)

    @property
    def pairs_per_forward(self) -> int:
        return self.micro_batching.pairs_per_forward

    def expert_for_step(self, step: int) -> str | None:
        return self.experts[step] if self.experts else None

    def as_dict(self) -> dict:
        return {**asdict(self), "pairs_per_forward": self.pairs_per_forward}

    def table(self) -> str:
        rows = [
            ("family", self.family),
            ("samples per rollout",
             f"{self.samples_per_rollout} = {self.rollout_batch_size} prompts x "
             f"{self.n_samples_per_prompt} samples"),
            ("global batch size", f"{self.global_batch_size} samples per optimizer step"),
            ("optimizer steps per rollout", str(self.num_steps_per_rollout)),
            ("trained steps per sample",
             f"{self.num_trained_steps} of {self.num_denoising_steps} ({self.step_strategy})"),
            ("train pairs", f"{self.train_pairs} = {self.samples_per_rollout} x {self.num_trained_steps}"),
            ("dp size", f"{self.dp_size} ({self.dp_split_mode} split)"),
            ("pairs per rank", str(self.pairs_per_rank)),
            ("pairs per optimizer step per rank", str(self.pairs_per_step_per_rank)),
            ("micro-batch", self.micro_batching.describe()),
            *([("rollout tile", f"{self.rollout_tile_samples} samples (one microgroup) x 1 timestep, as the "
                                f"engines forward them; every forward is one")] if self.rollout_tile_samples else []),
            ("pairs per forward", str(self.pairs_per_forward)),
            ("forwards per optimizer step", str(self.forwards_per_step)),
        ]
        rows += self._expert_rows()
        width = max(len(label) for label, _ in rows)
        lines = ["Batch plan"] + [f"  {label:<{width}}  {value}" for label, value in rows]
        return "\n".join(lines)

    def _expert_rows(self) -> list[tuple[str, str]]:
        if not self.experts:
            return []
        return [
            (f"step {step} (sigma {self.sigmas[step]:.4f})", f"trains {self.experts[step]}")
            for step in self.trainable_steps
        ]
