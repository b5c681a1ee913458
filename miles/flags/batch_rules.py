"""The batch-arithmetic rules and the batch plan they imply. Torch-free.

Every rule raises `ConfigError` with one line that names the values and the fix. The plan is
computed by walking the same pair functions (`miles.flags.batching`) the trainer walks, for every
DP rank and optimizer step, so a layout the plan accepts is the layout that gets trained.
"""

from __future__ import annotations

import itertools
import math
import re
from argparse import Namespace

from miles.flags.batching import (
    BatchLayoutError, BatchPlan, MicroBatchSpec, expand_pairs, micro_batches, rollout_tile_mismatch, shard_pairs,
    split_steps,
)
from miles.diffusion_facts.families import FamilyFacts, UnknownFamilyError, get_family_facts, resolve_family
from miles.diffusion_facts.schedule import expert_index_for_step, sigma_schedule

BUILTIN_STEP_STRATEGIES = ("sde_window", "epoch_global_random_choice")
DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*([.:][A-Za-z_]\w*)$")


class ConfigError(ValueError):
    """A flag combination that cannot run; the message is one line with the fix."""


# ---- facts derived from the flags, without mutating the namespace ----

def family_of(ns: Namespace) -> FamilyFacts:
    try:
        return get_family_facts(resolve_family(ns.diffusion_model_family, ns.hf_checkpoint))
    except UnknownFamilyError as error:
        raise ConfigError(str(error)) from None


def num_trained_steps(ns: Namespace) -> int:
    """--diffusion-num-sde-steps, else the reference's first int(steps x timestep fraction) steps."""
    return ns.diffusion_num_sde_steps or eligible_step_count(ns)


def eligible_step_count(ns: Namespace) -> int:
    """flow_grpo's num_train_timesteps = int(num_steps * timestep_fraction), at least one step."""
    return max(1, int(ns.diffusion_num_steps * getattr(ns, "diffusion_timestep_fraction", 1.0)))


def train_gpus(ns: Namespace) -> int:
    return ns.actor_num_nodes * ns.actor_num_gpus_per_node


def dp_size_of(ns: Namespace) -> int:
    world = train_gpus(ns)
    if world % ns.sequence_parallel_size:
        raise ConfigError(
            f"train ranks={world} (--actor-num-nodes {ns.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{ns.actor_num_gpus_per_node}) not divisible by --sequence-parallel-size "
            f"{ns.sequence_parallel_size}; fix: make the sequence-parallel size divide the train ranks"
        )
    return world // ns.sequence_parallel_size


def samples_per_rollout(ns: Namespace) -> int:
    return ns.rollout_batch_size * ns.n_samples_per_prompt


def _samples_text(ns: Namespace) -> str:
    return (f"samples per rollout={samples_per_rollout(ns)} (--rollout-batch-size {ns.rollout_batch_size} "
            f"x --n-samples-per-prompt {ns.n_samples_per_prompt})")


def derive_batch_sizes(ns: Namespace) -> tuple[float, int]:
    """(global_batch_size, num_steps_per_rollout): the unset one derived from the other.

    Given only the step count, the global batch may come out fractional; that is refused later, in
    `_check_global_batch`, so that the pair shard rule reports first with its documented message.
    """
    samples = samples_per_rollout(ns)
    gbs, steps = ns.global_batch_size, ns.num_steps_per_rollout
    if gbs is not None and steps is not None:
        if gbs * steps != samples:
            raise ConfigError(
                f"--global-batch-size {gbs} x --num-steps-per-rollout {steps} = {gbs * steps} contradicts "
                f"{_samples_text(ns)}; fix: set only one of the two, or make the product {samples}"
            )
        return gbs, steps
    if gbs is not None:
        if samples % gbs:
            raise ConfigError(
                f"{_samples_text(ns)} not divisible by --global-batch-size {gbs}; fix: pick a global "
                f"batch size that divides {samples}, or set --num-steps-per-rollout instead"
            )
        return gbs, samples // gbs
    return (samples if steps is None else samples / steps), (steps or 1)


# ---- the batch plan ----

def compute_batch_plan(ns: Namespace) -> BatchPlan:
    """The batch plan of these flags, or ConfigError for any batch-arithmetic rule they break."""
    family = family_of(ns)
    _check_step_choice(ns)
    dp_size = dp_size_of(ns)
    gbs, steps_per_rollout = derive_batch_sizes(ns)
    spec = micro_batch_spec(ns)
    windows = _all_windows(ns, dp_size, steps_per_rollout)
    gbs = _check_global_batch(ns, gbs, steps_per_rollout, dp_size)
    forwards = _tile_for_ranks(ns, dp_size, steps_per_rollout, windows, spec)
    sigmas = tuple(sigma_schedule(ns.diffusion_num_steps, shift_of(ns, family)))
    experts = _experts_per_step(family, sigmas, ns.diffusion_num_steps)
    _check_phase_purity(ns, family, experts, forwards)
    _check_rollout_tiles(ns, dp_size, steps_per_rollout, spec, forwards)
    window = windows[0][0]
    return BatchPlan(
        family=family.name,
        rollout_batch_size=ns.rollout_batch_size,
        n_samples_per_prompt=ns.n_samples_per_prompt,
        samples_per_rollout=samples_per_rollout(ns),
        global_batch_size=gbs,
        num_steps_per_rollout=steps_per_rollout,
        num_denoising_steps=ns.diffusion_num_steps,
        num_trained_steps=num_trained_steps(ns),
        train_pairs=samples_per_rollout(ns) * num_trained_steps(ns),
        dp_size=dp_size,
        dp_split_mode=ns.train_dp_split_mode,
        pairs_per_rank=len(window) * steps_per_rollout,
        pairs_per_step_per_rank=len(window),
        micro_batching=spec,
        forwards_per_step=len(forwards[0][0]),
        step_strategy=ns.diffusion_step_strategy_path,
        trainable_steps=trainable_steps(ns),
        sigmas=sigmas if experts else (),
        experts=experts,
        rollout_tile_samples=rollout_microgroup(ns) or 0,
    )


def shift_of(ns: Namespace, family: FamilyFacts) -> float:
    return ns.diffusion_shift if ns.diffusion_shift is not None else family.default_shift


def micro_batch_spec(ns: Namespace) -> MicroBatchSpec:
    """The micro-batch flags; none given: the rollout tile (one microgroup x 1 timestep), or one pair
    per forward without rollouts (SFT)."""
    tile = (ns.micro_batch_size_sample, ns.micro_batch_size_tstep)
    if (tile[0] is None) != (tile[1] is None):
        raise ConfigError(
            f"--micro-batch-size-sample {tile[0]} and --micro-batch-size-tstep {tile[1]}: a 2D tile "
            f"needs both; fix: set both, or neither to use the flat --micro-batch-size"
        )
    if tile[0] is not None and (ns.micro_batch_size or 1) > 1:
        raise ConfigError(
            f"--micro-batch-size {ns.micro_batch_size} has no effect beside the 2D tile --micro-batch-size-sample "
            f"{tile[0]} --micro-batch-size-tstep {tile[1]}, which sets the micro-batch; fix: change the tile "
            f"flags instead, or drop --micro-batch-size"
        )
    if ns.micro_batch_size is None and tile[0] is None:
        group = rollout_microgroup(ns)
        tile = (group, 1) if group else tile
    return MicroBatchSpec(size=ns.micro_batch_size or 1, tile_samples=tile[0], tile_steps=tile[1],
                          iter_order=ns.diffusion_train_iter_order)


def rollout_microgroup(ns: Namespace) -> int | None:
    """Samples per engine forward when the trainer recomputes rollouts; None under SFT (no rollouts)."""
    if ns.loss_type == "sft_loss":
        return None
    return ns.rollout_microgroup_size or ns.n_samples_per_prompt


# ---- the rollout tile: every train forward is one the engines ran ----

def _check_rollout_tiles(ns: Namespace, dp_size: int, steps_per_rollout: int, spec: MicroBatchSpec,
                         forwards) -> None:
    group = rollout_microgroup(ns)
    if group is None:
        return
    problem = _tile_problem(forwards, group)
    if problem is None:
        return
    raise ConfigError(
        f"the micro-batch (--micro-batch-size: {spec.describe()}) cannot reproduce the engines' forwards: {problem}, and each train "
        f"forward must be one microgroup of --rollout-microgroup-size {group} samples at one timestep, as the "
        f"engines ran it (else parity is not exact); fix: {_rollout_tile_fix(ns, dp_size, steps_per_rollout)}"
    )


def _tile_for_ranks(ns: Namespace, dp_size: int, steps_per_rollout: int, windows, spec: MicroBatchSpec):
    """`_tile_default_tile`; when the micro-batch flags given fit fewer train ranks, the refusal names
    the rank count first (it split each optimizer step too finely) and the counts that fit. (The
    default rollout tile keeps its own message, whose fix keeps the ranks.)"""
    try:
        return _tile_default_tile(ns, dp_size, steps_per_rollout, windows, spec)
    except ConfigError as error:
        given = ns.micro_batch_size is not None or ns.micro_batch_size_sample is not None
        fitting = [n for n in range(1, dp_size) if given and _ranks_tile(ns, n, steps_per_rollout, spec)]
        if not fitting:
            raise
        what, fix = str(error).split("; fix: ", 1)
        raise ConfigError(
            f"{dp_size} train ranks (--actor-num-nodes {ns.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{ns.actor_num_gpus_per_node}) split each optimizer step too finely for the micro-batch: {what}; fix: "
            f"{' or '.join(map(str, fitting))} train rank(s) fit it, or {fix}"
        ) from None


def _ranks_tile(ns: Namespace, dp_size: int, steps_per_rollout: int, spec: MicroBatchSpec) -> bool:
    try:
        _tile_default_tile(ns, dp_size, steps_per_rollout, _all_windows(ns, dp_size, steps_per_rollout), spec)
    except ConfigError:
        return False
    return True


def _tile_default_tile(ns: Namespace, dp_size: int, steps_per_rollout: int, windows, spec: MicroBatchSpec):
    """`_tile_all`, with the rollout tile's own message when unset flags chose it and it does not fit."""
    try:
        return _tile_all(windows, spec)
    except ConfigError as error:
        unset = ns.micro_batch_size is None and ns.micro_batch_size_sample is None
        if not (unset and rollout_microgroup(ns)):
            raise
        raise ConfigError(
            f"the rollout tile (no micro-batch flags: one microgroup of --rollout-microgroup-size "
            f"{rollout_microgroup(ns)} samples x 1 timestep per forward) does not fit: {str(error).split('; fix:')[0]}; "
            f"fix: {_rollout_tile_fix(ns, dp_size, steps_per_rollout)}"
        ) from None


def _tile_problem(forwards, group: int) -> str | None:
    for rank in forwards:
        for step in rank:
            for forward in step:
                problem = rollout_tile_mismatch(forward, group)
                if problem is not None:
                    return problem
    return None


def _rollout_tile_fix(ns: Namespace, dp_size: int, steps_per_rollout: int) -> str:
    """The first of the usual layouts that reproduces the rollout tile under these flags."""
    group = rollout_microgroup(ns)
    flat = {"micro_batch_size_sample": None, "micro_batch_size_tstep": None}
    instead = f" (in place of --micro-batch-size {ns.micro_batch_size})" if ns.micro_batch_size else ""
    candidates = [
        (f"--micro-batch-size-sample {group} --micro-batch-size-tstep 1{instead}",
         {"micro_batch_size_sample": group, "micro_batch_size_tstep": 1, "micro_batch_size": None}),
        (f"--micro-batch-size-sample {group} --micro-batch-size-tstep 1 --train-dp-split-mode contiguous{instead}",
         {"micro_batch_size_sample": group, "micro_batch_size_tstep": 1, "train_dp_split_mode": "contiguous",
          "micro_batch_size": None}),
        (f"--micro-batch-size {group} (one trained step per sample)", {**flat, "micro_batch_size": group}),
        ("--rollout-microgroup-size 1 --micro-batch-size 1",
         {**flat, "rollout_microgroup_size": 1, "micro_batch_size": 1}),
    ]
    if ns.micro_batch_size_sample and ns.n_samples_per_prompt % ns.micro_batch_size_sample == 0:
        candidates.insert(0, (f"--rollout-microgroup-size {ns.micro_batch_size_sample} --micro-batch-size-tstep 1",
                              {"rollout_microgroup_size": ns.micro_batch_size_sample, "micro_batch_size_tstep": 1}))
    for text, changes in candidates:
        if _reproduces(Namespace(**{**vars(ns), **changes}), dp_size, steps_per_rollout):
            return text
    return (f"--rollout-microgroup-size 1 --micro-batch-size 1 with --rollout-batch-size, --n-samples-per-prompt "
            f"and --num-steps-per-rollout that deal whole samples")


def _reproduces(ns: Namespace, dp_size: int, steps_per_rollout: int) -> bool:
    try:
        forwards = _tile_all(_all_windows(ns, dp_size, steps_per_rollout), micro_batch_spec(ns))
    except ConfigError:
        return False
    return _tile_problem(forwards, rollout_microgroup(ns)) is None


def _check_step_choice(ns: Namespace) -> None:
    steps, trained = ns.diffusion_num_steps, num_trained_steps(ns)
    if trained > steps:
        raise ConfigError(
            f"--diffusion-num-sde-steps {trained} > --diffusion-num-steps {steps}; fix: train at most "
            f"{steps} steps per sample"
        )
    strategy, max_start = ns.diffusion_step_strategy_path, ns.diffusion_sde_window_max_start
    if strategy != "sde_window" and max_start:
        raise ConfigError(
            f"--diffusion-sde-window-max-start {max_start} applies to the sde_window strategy only, "
            f"not {strategy}; fix: drop it"
        )
    if strategy == "sde_window" and max_start + trained > steps:
        raise ConfigError(
            f"sde_window: --diffusion-sde-window-max-start {max_start} + --diffusion-num-sde-steps "
            f"{trained} > --diffusion-num-steps {steps}; fix: lower the max start to {steps - trained}"
        )
    if strategy not in BUILTIN_STEP_STRATEGIES and not DOTTED_PATH.match(strategy):
        raise ConfigError(
            f"--diffusion-step-strategy-path {strategy!r} is neither "
            f"{' nor '.join(BUILTIN_STEP_STRATEGIES)} nor a pkg.mod:fn / pkg.mod.fn path"
        )


def _all_windows(ns: Namespace, dp_size: int, steps_per_rollout: int) -> list[list[list]]:
    """Every rank's optimizer-step windows, for trained steps named by their position 0..k-1.

    The layout depends only on how many steps are trained, never on which ones.
    """
    pairs = expand_pairs(samples_per_rollout(ns), range(num_trained_steps(ns)))
    try:
        shards = [shard_pairs(pairs, dp_size, rank, ns.train_dp_split_mode) for rank in range(dp_size)]
    except BatchLayoutError:
        raise ConfigError(
            f"train pairs={len(pairs)} ({_samples_text(ns)} x {num_trained_steps(ns)} trained steps) "
            f"not divisible by dp_size={dp_size}; fix: adjust --rollout-batch-size, "
            f"--n-samples-per-prompt or the train ranks"
        ) from None
    try:
        return [split_steps(shard, steps_per_rollout) for shard in shards]
    except BatchLayoutError as error:
        raise ConfigError(
            f"{error}; fix: adjust --rollout-batch-size, --n-samples-per-prompt or "
            f"--num-steps-per-rollout so the pairs per rank split evenly into optimizer steps"
        ) from None


def _check_global_batch(ns: Namespace, gbs: float, steps_per_rollout: int, dp_size: int) -> int:
    if gbs != int(gbs):
        raise ConfigError(
            f"{_samples_text(ns)} not divisible by --num-steps-per-rollout {steps_per_rollout}, so an "
            f"optimizer step would hold {gbs:g} samples; fix: make num_steps_per_rollout divide "
            f"{samples_per_rollout(ns)}"
        )
    if int(gbs) % dp_size:
        raise ConfigError(
            f"global_batch_size={int(gbs)} not divisible by dp_size={dp_size}; fix: adjust "
            f"--global-batch-size / --num-steps-per-rollout or the train ranks so each rank gets "
            f"whole samples per optimizer step"
        )
    return int(gbs)


def _tile_all(windows: list[list[list]], spec: MicroBatchSpec) -> list[list[list[list]]]:
    try:
        forwards = [[micro_batches(window, spec) for window in rank] for rank in windows]
    except BatchLayoutError as error:
        raise ConfigError(f"{error}; fix: {_tiling_fix(spec)}") from None
    counts = {len(step) for rank in forwards for step in rank}
    if len(counts) != 1:
        raise ConfigError(
            f"optimizer steps would run different numbers of forwards ({sorted(counts)}); fix: "
            f"{_tiling_fix(spec)}"
        )
    return forwards


def _tiling_fix(spec: MicroBatchSpec) -> str:
    if spec.is_2d:
        return ("pick --micro-batch-size-sample / --micro-batch-size-tstep that divide the samples and "
                "timesteps of each optimizer step (--train-dp-split-mode contiguous keeps steps whole), "
                "or use the flat --micro-batch-size")
    return "pick a --micro-batch-size that divides the pairs per optimizer step per rank"


# ---- Wan2.2: one expert per forward ----

def _experts_per_step(family: FamilyFacts, sigmas: tuple[float, ...], num_steps: int) -> tuple[str, ...]:
    if family.boundary_ratio is None or family.num_experts < 2:
        return ()
    return tuple(family.transformer_components[expert_index_for_step(list(sigmas), step, family.boundary_ratio)]
                 for step in range(num_steps))


def high_noise_step_count(experts: tuple[str, ...]) -> int:
    """Steps on the first expert; sigmas fall monotonically, so they are a prefix."""
    return sum(1 for expert in experts if expert == experts[0]) if experts else 0


def trainable_steps(ns: Namespace) -> tuple[int, ...]:
    """Every denoising step that some choice the step strategy may make trains."""
    if ns.diffusion_step_strategy_path == "sde_window":
        return tuple(range(_min_start(ns), ns.diffusion_sde_window_max_start + num_trained_steps(ns)))
    candidates = getattr(ns, "diffusion_sde_candidate_steps", None)
    if candidates and ns.diffusion_step_strategy_path == "epoch_global_random_choice":
        return tuple(sorted(candidates))
    return tuple(range(ns.diffusion_num_steps))


MAX_LISTED_CHOICES = 10_000


def candidate_step_sets(ns: Namespace) -> list[tuple[int, ...]] | None:
    """The trained-step lists the strategy may choose, or None when there are too many to list."""
    k = num_trained_steps(ns)
    if ns.diffusion_step_strategy_path == "sde_window":
        return [tuple(range(start, start + k)) for start in range(_min_start(ns), ns.diffusion_sde_window_max_start + 1)]
    candidates = getattr(ns, "diffusion_sde_candidate_steps", None)
    if candidates and ns.diffusion_step_strategy_path == "epoch_global_random_choice":
        if math.comb(len(candidates), k) <= MAX_LISTED_CHOICES:
            return list(itertools.combinations(sorted(candidates), k))
    return None


def _min_start(ns: Namespace) -> int:
    return getattr(ns, "diffusion_sde_window_min_start", 0) or 0


def _check_phase_purity(ns: Namespace, family: FamilyFacts, experts: tuple[str, ...], forwards) -> None:
    boundary = high_noise_step_count(experts)
    if not experts or boundary in (0, ns.diffusion_num_steps):
        return
    position_sets = {frozenset(pair.step for pair in forward)
                     for rank in forwards for step in rank for forward in step}
    for positions in sorted(position_sets, key=sorted):
        mixed = _mixed_step_choice(ns, positions, boundary)
        if mixed is not None:
            raise ConfigError(
                f"Micro-batch mixes denoising phases (Wan2.2): a forward would hold steps "
                f"{list(mixed)} across the expert boundary at step {boundary} ({experts[0]} before, "
                f"{experts[-1]} from there; {ns.diffusion_step_strategy_path}, "
                f"{micro_batch_spec(ns).describe()}); fix: --micro-batch-size 1 or a phase-pure "
                f"tiling (e.g. --micro-batch-size-sample S --micro-batch-size-tstep 1)"
            )


def _mixed_step_choice(ns: Namespace, positions: frozenset, boundary: int) -> tuple[int, ...] | None:
    """Denoising steps of one forward that some allowed choice puts on both experts, else None."""
    if len(positions) < 2:
        return None
    candidates = candidate_step_sets(ns)
    if candidates is not None:
        for steps in candidates:
            chosen = tuple(steps[p] for p in sorted(positions))
            if chosen[0] < boundary <= chosen[-1]:
                return chosen
        return None
    return _mixed_any_subset(ns, positions, boundary)


def _mixed_any_subset(ns: Namespace, positions: frozenset, boundary: int) -> tuple[int, ...] | None:
    """Random or custom strategies: assume any k of the N steps (of the candidates, when given) may come up.

    The rollout sorts whatever a strategy returns, so position p holds the p-th smallest chosen
    step. The earliest position can sit before the boundary when at least first + 1 steps lie
    before it, and the latest after it when at least k - last steps lie from it on.
    """
    k, pool = num_trained_steps(ns), trainable_steps(ns)
    first, last = min(positions), max(positions)
    before = [s for s in pool if s < boundary]
    after = [s for s in pool if s >= boundary]
    if len(before) > first and len(after) >= k - last:
        return (before[-1], after[0])
    return None
