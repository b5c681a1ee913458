"""Validation of train_diffusion.py's parsed flags, and the batch plan they imply. Torch-free.

Every rule raises `ConfigError` with one line that names the values and the fix. The batch plan is
computed by walking the same pair functions (`miles.utils.batching`) the trainer walks, so a
layout that the plan accepts is the layout that gets trained.

The GPU layout rule (GPUs are CPU worker slots with --device cpu):
    train GPUs   = actor_num_nodes x actor_num_gpus_per_node
    rollout GPUs = --rollout-num-gpus (unset: the train GPUs with --colocate, else 1);
                   0 without engines (--train-only or sft_loss); shared with training under --colocate
    reward GPUs  = ceil(rm_num_workers x rm_num_gpus_per_worker); 0 with --colocate-reward or sft_loss
    train + unshared rollout + reward GPUs <= num_nodes x num_gpus_per_node
"""

from __future__ import annotations

import math
import re
from argparse import Namespace
from dataclasses import dataclass

from miles.utils.batching import (
    BatchLayoutError, BatchPlan, MicroBatchSpec, expand_pairs, micro_batches, shard_pairs, split_steps,
)
from miles.utils.families import FamilyFacts, UnknownFamilyError, get_family_facts, resolve_family
from miles.utils.schedule import expert_index_for_step, sigma_schedule

BUILTIN_STEP_STRATEGIES = ("sde_window", "epoch_global_random_choice")
DEFAULT_LORA_RANK = 32
_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*([.:][A-Za-z_]\w*)$")


class ConfigError(ValueError):
    """A flag combination that cannot run; the message is one line with the fix."""


# ---- facts derived from the flags, without mutating the namespace ----

def family_of(ns: Namespace) -> FamilyFacts:
    try:
        return get_family_facts(resolve_family(ns.diffusion_model_family, ns.hf_checkpoint))
    except UnknownFamilyError as error:
        raise ConfigError(str(error)) from None


def num_trained_steps(ns: Namespace) -> int:
    return ns.diffusion_num_sde_steps or ns.diffusion_num_steps


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


def derive_batch_sizes(ns: Namespace) -> tuple[int, int]:
    """(global_batch_size, num_steps_per_rollout): the unset one derived from the other."""
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
    forwards = _tile_all(windows, spec)
    sigmas = tuple(sigma_schedule(ns.diffusion_num_steps, shift_of(ns, family)))
    experts = _experts_per_step(family, sigmas, ns.diffusion_num_steps)
    _check_phase_purity(ns, family, experts, forwards)
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
    )


def shift_of(ns: Namespace, family: FamilyFacts) -> float:
    return ns.diffusion_shift if ns.diffusion_shift is not None else family.default_shift


def micro_batch_spec(ns: Namespace) -> MicroBatchSpec:
    tile = (ns.micro_batch_size_sample, ns.micro_batch_size_tstep)
    if (tile[0] is None) != (tile[1] is None):
        raise ConfigError(
            f"--micro-batch-size-sample {tile[0]} and --micro-batch-size-tstep {tile[1]}: a 2D tile "
            f"needs both; fix: set both, or neither to use the flat --micro-batch-size"
        )
    return MicroBatchSpec(size=ns.micro_batch_size, tile_samples=tile[0], tile_steps=tile[1],
                          iter_order=ns.diffusion_train_iter_order)


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
    if strategy not in BUILTIN_STEP_STRATEGIES and not _DOTTED_PATH.match(strategy):
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
        return tuple(range(ns.diffusion_sde_window_max_start + num_trained_steps(ns)))
    return tuple(range(ns.diffusion_num_steps))


def candidate_step_sets(ns: Namespace) -> list[tuple[int, ...]] | None:
    """The trained-step lists the strategy may choose, or None when there are too many to list."""
    k, steps = num_trained_steps(ns), ns.diffusion_num_steps
    if ns.diffusion_step_strategy_path == "sde_window":
        return [tuple(range(start, start + k)) for start in range(ns.diffusion_sde_window_max_start + 1)]
    return None


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
    """Random or custom strategies: any ascending choice of k of the N steps may come up.

    The earliest position sits before the boundary if enough steps lie before it, and the latest
    after it if enough steps lie after it; for a custom strategy, whose order is unknown, any two
    positions may straddle it.
    """
    k, steps = num_trained_steps(ns), ns.diffusion_num_steps
    first, last = min(positions), max(positions)
    ascending = ns.diffusion_step_strategy_path == "epoch_global_random_choice"
    if ascending and not (first < boundary and k - last <= steps - boundary):
        return None
    return (boundary - 1, boundary)


# ---- everything else: defaults that depend on other flags, cross-flag rules, GPU layout ----

def validate_args(ns: Namespace) -> BatchPlan:
    """Check every rule, fill in the derived values (the trainer reads them) and return the plan."""
    family = family_of(ns)
    check_cross_flag_rules(ns, family)
    plan = compute_batch_plan(ns)
    check_guidance_scale_2(ns, plan)
    check_gpu_layout(ns)
    fill_derived_values(ns, family, plan)
    return plan


def fill_derived_values(ns: Namespace, family: FamilyFacts, plan: BatchPlan) -> None:
    ns.diffusion_model_family = family.name
    ns.diffusion_sde_type = ns.diffusion_sde_type or family.default_sde_type
    ns.diffusion_shift = shift_of(ns, family)
    ns.diffusion_num_sde_steps = plan.num_trained_steps
    ns.global_batch_size = plan.global_batch_size
    ns.num_steps_per_rollout = plan.num_steps_per_rollout
    ns.rollout_num_gpus = rollout_gpus(ns)
    ns.num_nodes = job_nodes(ns)
    ns.rollout_microgroup_size = ns.rollout_microgroup_size or ns.n_samples_per_prompt
    ns.update_weight_target_module = ns.update_weight_target_module or list(family.transformer_components)
    ns.diffusion_kl_reference = kl_reference(ns)
    if ns.use_lora:
        ns.lora_rank = ns.lora_rank or DEFAULT_LORA_RANK
        ns.lora_alpha = ns.lora_alpha or ns.lora_rank
        ns.lora_target_modules = ns.lora_target_modules or list(family.lora_target_modules)
    if ns.start_rollout_id is None and not ns.load:
        ns.start_rollout_id = 0
    if not ns.run_dir:
        import time

        ns.run_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def kl_reference(ns: Namespace) -> str:
    if ns.diffusion_kl_reference != "auto":
        return ns.diffusion_kl_reference
    if ns.use_lora:
        return "lora_base"
    return "ema" if ns.use_ema else "auto"


def has_rollout_engines(ns: Namespace) -> bool:
    return not (ns.train_only or ns.loss_type == "sft_loss")


def check_cross_flag_rules(ns: Namespace, family: FamilyFacts) -> None:
    for rule in (_run_length, _checkpointing, _lora_flags, _run_modes, _kl_reference, _reward_source,
                 _dotted_paths, _prompt_data, _learning_rates, _microgroups, _target_modules):
        rule(ns, family)


def _run_length(ns: Namespace, family: FamilyFacts) -> None:
    if (ns.num_rollout is None) == (ns.num_epoch is None):
        given = "neither was given" if ns.num_rollout is None else (
            f"both were given (--num-rollout {ns.num_rollout}, --num-epoch {ns.num_epoch})")
        raise ConfigError(f"exactly one of --num-rollout or --num-epoch is required, {given}; fix: keep one")


def _checkpointing(ns: Namespace, family: FamilyFacts) -> None:
    if ns.save_interval is not None and not ns.save:
        raise ConfigError(f"--save-interval {ns.save_interval} needs --save DIR; fix: add --save or drop "
                          f"--save-interval")


def _lora_flags(ns: Namespace, family: FamilyFacts) -> None:
    given = [flag for flag, value in (("--lora-rank", ns.lora_rank), ("--lora-alpha", ns.lora_alpha),
                                      ("--lora-target-modules", ns.lora_target_modules)) if value is not None]
    if given and not ns.use_lora:
        raise ConfigError(f"{', '.join(given)} given without --use-lora; fix: add --use-lora or drop them")


def _run_modes(ns: Namespace, family: FamilyFacts) -> None:
    if ns.train_only and ns.loss_type != "sft_loss":
        raise ConfigError(f"--train-only runs no rollout engines, which --loss-type {ns.loss_type} needs; "
                          f"fix: use --loss-type sft_loss or drop --train-only")
    if ns.debug_rollout_only and not has_rollout_engines(ns):
        raise ConfigError(f"--debug-rollout-only needs rollouts, but --train-only / --loss-type "
                          f"{ns.loss_type} runs none; fix: drop one of them")


def _kl_reference(ns: Namespace, family: FamilyFacts) -> None:
    if ns.diffusion_kl_beta <= 0:
        return
    reference = kl_reference(ns)
    if reference == "auto":
        raise ConfigError(f"--diffusion-kl-beta {ns.diffusion_kl_beta} needs a reference policy; fix: add "
                          f"--use-lora (KL vs the LoRA base) or --use-ema (KL vs the EMA)")
    needed = {"lora_base": ("use_lora", "--use-lora"), "ema": ("use_ema", "--use-ema")}[reference]
    if not getattr(ns, needed[0]):
        raise ConfigError(f"--diffusion-kl-reference {reference} needs {needed[1]}; fix: add {needed[1]} or "
                          f"choose another reference")


def _reward_source(ns: Namespace, family: FamilyFacts) -> None:
    if ns.rm_type and ns.custom_rm_path:
        raise ConfigError(f"--rm-type {ns.rm_type} and --custom-rm-path {ns.custom_rm_path} both given; "
                          f"fix: keep one")
    if ns.loss_type != "sft_loss" and not (ns.rm_type or ns.custom_rm_path):
        raise ConfigError(f"--loss-type {ns.loss_type} needs a reward; fix: add --rm-type NAME or "
                          f"--custom-rm-path pkg.mod:fn")


def _dotted_paths(ns: Namespace, family: FamilyFacts) -> None:
    for flag, value in (("--custom-rm-path", ns.custom_rm_path),
                        ("--custom-loss-function-path", ns.custom_loss_function_path)):
        if value and not _DOTTED_PATH.match(value):
            raise ConfigError(f"{flag} {value!r} is not a pkg.mod:fn or pkg.mod.fn path; fix: name the "
                              f"function by its import path")


def _prompt_data(ns: Namespace, family: FamilyFacts) -> None:
    if not ns.prompt_data:
        raise ConfigError("--prompt-data is required (a JSONL file of prompts, or SFT items); fix: add "
                          "--prompt-data FILE.jsonl")


def _learning_rates(ns: Namespace, family: FamilyFacts) -> None:
    if ns.min_lr > ns.lr:
        raise ConfigError(f"--min-lr {ns.min_lr} > --lr {ns.lr}; fix: lower --min-lr")


def _microgroups(ns: Namespace, family: FamilyFacts) -> None:
    size = ns.rollout_microgroup_size
    if size is not None and ns.n_samples_per_prompt % size:
        raise ConfigError(f"--rollout-microgroup-size {size} does not divide --n-samples-per-prompt "
                          f"{ns.n_samples_per_prompt}; fix: pick a divisor")


def _target_modules(ns: Namespace, family: FamilyFacts) -> None:
    unknown = [m for m in ns.update_weight_target_module or () if m not in family.transformer_components]
    if unknown:
        raise ConfigError(f"--update-weight-target-module {' '.join(unknown)}: {family.name} has only "
                          f"{', '.join(family.transformer_components)}; fix: name those")
    if ns.diffusion_guidance_scale_2 is not None and family.num_experts < 2:
        raise ConfigError(f"--diffusion-guidance-scale-2 given but {family.name} has one expert; fix: drop it")


def check_guidance_scale_2(ns: Namespace, plan: BatchPlan) -> None:
    """Wan2.2's low-noise expert has its own guidance scale; no silent fallback to the first."""
    if not plan.experts or ns.diffusion_guidance_scale_2 is not None:
        return
    low = plan.experts[-1]
    if low == plan.experts[0]:
        return
    samples_low = has_rollout_engines(ns) or ns.eval_interval is not None
    trains_low = any(plan.experts[step] == low for step in plan.trainable_steps)
    if samples_low or trains_low:
        first_low = plan.experts.index(low)
        why = "trains" if trains_low else "samples"
        raise ConfigError(f"--diffusion-guidance-scale-2 is required: the run {why} steps {first_low}.."
                          f"{len(plan.experts) - 1} on the low-noise expert {low}; fix: add "
                          f"--diffusion-guidance-scale-2 SCALE")


def job_nodes(ns: Namespace) -> int:
    return ns.num_nodes or ns.actor_num_nodes


def rollout_gpus(ns: Namespace) -> int:
    if ns.rollout_num_gpus is not None:
        return ns.rollout_num_gpus
    return train_gpus(ns) if ns.colocate else 1


def reward_gpus(ns: Namespace) -> int:
    if ns.colocate_reward or ns.loss_type == "sft_loss":
        return 0
    return math.ceil(ns.rm_num_workers * ns.rm_num_gpus_per_worker - 1e-9)


@dataclass(frozen=True)
class GpuLayout:
    train: int
    rollout: int
    rollout_shared: bool
    reward: int
    available: int

    @property
    def needed(self) -> int:
        return self.train + (0 if self.rollout_shared else self.rollout) + self.reward


def gpu_layout(ns: Namespace) -> GpuLayout:
    rollout = rollout_gpus(ns) if has_rollout_engines(ns) else 0
    return GpuLayout(train=train_gpus(ns), rollout=rollout, rollout_shared=bool(ns.colocate),
                     reward=reward_gpus(ns), available=job_nodes(ns) * ns.num_gpus_per_node)


def check_gpu_layout(ns: Namespace) -> None:
    unit = "CPU slots" if ns.device == "cpu" else "GPUs"
    if ns.actor_num_gpus_per_node > ns.num_gpus_per_node:
        raise ConfigError(f"--actor-num-gpus-per-node {ns.actor_num_gpus_per_node} > --num-gpus-per-node "
                          f"{ns.num_gpus_per_node}; fix: lower it or raise --num-gpus-per-node")
    if ns.actor_num_nodes > job_nodes(ns):
        raise ConfigError(f"--actor-num-nodes {ns.actor_num_nodes} > --num-nodes {job_nodes(ns)}; fix: raise "
                          f"--num-nodes")
    layout = gpu_layout(ns)
    if layout.rollout % ns.rollout_num_gpus_per_engine:
        raise ConfigError(f"rollout {unit}={layout.rollout} not divisible by --rollout-num-gpus-per-engine "
                          f"{ns.rollout_num_gpus_per_engine}; fix: make --rollout-num-gpus a multiple of it")
    if layout.rollout_shared and layout.rollout > layout.train:
        raise ConfigError(f"--colocate shares the train {unit} with rollout, but --rollout-num-gpus "
                          f"{layout.rollout} > train {unit}={layout.train}; fix: lower --rollout-num-gpus "
                          f"or drop --colocate")
    if layout.needed > layout.available:
        raise ConfigError(_layout_message(ns, layout, unit))


def _layout_message(ns: Namespace, layout: GpuLayout, unit: str) -> str:
    rollout = "shared (--colocate)" if layout.rollout_shared else str(layout.rollout)
    return (f"the GPU layout needs {layout.needed} {unit} (train {layout.train} = {ns.actor_num_nodes} x "
            f"{ns.actor_num_gpus_per_node}, rollout {rollout}, reward {layout.reward} = "
            f"{ns.rm_num_workers} x {ns.rm_num_gpus_per_worker}) but the job has {layout.available} "
            f"(--num-nodes {job_nodes(ns)} x --num-gpus-per-node {ns.num_gpus_per_node}); fix: raise "
            f"--num-gpus-per-node/--num-nodes, pass --colocate, or lower the train/rollout/reward counts")
