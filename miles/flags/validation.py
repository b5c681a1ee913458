"""Validation of train_diffusion.py's parsed flags: cross-flag rules, the GPU layout, and the
values that default from other flags. Torch-free. The batch arithmetic lives in `batch_rules`.

The GPU layout rule (GPUs are CPU worker slots with --device cpu):
    train GPUs   = actor_num_nodes x actor_num_gpus_per_node
    rollout GPUs = --rollout-num-gpus (unset: the train GPUs with --colocate, else 1);
                   0 without engines (--train-only or sft_loss); shared with training under --colocate
    reward GPUs  = ceil(rm_num_workers x rm_num_gpus_per_worker); 0 with --colocate-reward or sft_loss
    train + unshared rollout + reward GPUs <= num_nodes x num_gpus_per_node
"""

from __future__ import annotations

import math
import time
from argparse import Namespace
from dataclasses import dataclass

from miles.flags.batch_rules import (
    DOTTED_PATH, ConfigError, compute_batch_plan, family_of, train_gpus, trainable_steps,
)
from miles.flags.batching import BatchPlan
from miles.flags.capability_rules import check_capability_flags
from miles.diffusion_facts.families import FamilyFacts

__all__ = ["ConfigError", "compute_batch_plan", "validate_args"]

DEFAULT_LORA_RANK = 32
DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE = 512 * 1024 ** 2  # bytes: few broadcasts, small next to any engine's weights


def validate_args(ns: Namespace) -> BatchPlan:
    """Check every rule, fill in the derived values (the trainer reads them) and return the plan.

    Derived values are written back (family, SDE type, SDE steps, global batch size, steps
    per rollout, rollout GPUs, nodes, microgroup size, target modules, KL reference, LoRA rank,
    alpha and targets, start rollout id, run dir), so validating the result again is a no-op.
    """
    family = family_of(ns)
    resolve_algorithm_defaults(ns)
    check_cross_flag_rules(ns, family)
    plan = compute_batch_plan(ns)
    check_guidance_scale_2(ns, plan)
    check_gpu_layout(ns)
    fill_derived_values(ns, family, plan)
    return plan


def fill_derived_values(ns: Namespace, family: FamilyFacts, plan: BatchPlan) -> None:
    ns.diffusion_model_family = family.name
    ns.diffusion_sde_type = ns.diffusion_sde_type or family.default_sde_type
    # diffusion_shift stays unset unless given: the checkpoint's own scheduler config decides
    ns.diffusion_num_sde_steps = plan.num_trained_steps
    ns.global_batch_size = plan.global_batch_size
    ns.num_steps_per_rollout = plan.num_steps_per_rollout
    ns.rollout_num_gpus = rollout_gpus(ns)
    ns.num_nodes = job_nodes(ns)
    ns.rollout_microgroup_size = ns.rollout_microgroup_size or ns.n_samples_per_prompt
    if ns.micro_batch_size is None:  # unset: the plan's layout (the rollout tile), written as its flags
        spec = plan.micro_batching
        ns.micro_batch_size = spec.size
        if spec.is_2d:
            ns.micro_batch_size_sample, ns.micro_batch_size_tstep = spec.tile_samples, spec.tile_steps
    ns.update_weight_target_module = ns.update_weight_target_module or list(family.transformer_components)
    ns.diffusion_kl_reference = kl_reference(ns)
    if ns.weight_sync == "bucketed":
        ns.update_weight_buffer_size = ns.update_weight_buffer_size or DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
    if ns.use_lora:
        ns.lora_rank = ns.lora_rank or DEFAULT_LORA_RANK
        ns.lora_alpha = ns.lora_alpha or ns.lora_rank
        ns.lora_target_modules = ns.lora_target_modules or list(family.lora_target_modules)
    if ns.start_rollout_id is None and not ns.load:
        ns.start_rollout_id = 0
    if not ns.run_dir:
        ns.run_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


# DiffusionNFT's KL weight (config/base.py train.beta); its trainer has a KL only against the LoRA base
NFT_REFERENCE_KL_BETA = 1e-4
EMA_DECAY_SCHEDULE_FLAGS = {"ema_decay_init": 0.0, "ema_decay_ramp": 0.001, "ema_decay_max": 0.5,
                            "ema_decay_flat_steps": 0}


def resolve_algorithm_defaults(ns: Namespace) -> None:
    """The defaults that depend on the loss (each the reference's; docs/algorithms.md)."""
    nft = ns.loss_type == "nft"
    if ns.diffusion_kl_beta is None:
        ns.diffusion_kl_beta = NFT_REFERENCE_KL_BETA if nft and ns.use_lora else 0.0
    if getattr(ns, "ema_rollout_policy", None) is None:
        ns.ema_rollout_policy = "ema" if nft else "live"


def _algorithm_flags(ns: Namespace, family: FamilyFacts) -> None:
    """Flags of one loss or one rollout policy, refused where they would do nothing."""
    nft = ns.loss_type == "nft"
    if ns.ema_rollout_policy == "ema" and not nft:
        raise ConfigError(f"--ema-rollout-policy ema with --loss-type {ns.loss_type}: only DiffusionNFT samples from an "
                          f"old policy; fix: drop it or use --loss-type nft")
    if ns.ema_rollout_policy == "ema" and getattr(ns, "train_backend", "dp") != "dp":
        raise ConfigError(f"--ema-rollout-policy ema with --train-backend {ns.train_backend}: the old policy is kept "
                          f"and checkpointed by the dp backend only; fix: --train-backend dp or "
                          f"--ema-rollout-policy live")
    if ns.ema_rollout_policy == "ema" and getattr(ns, "offload_train", False):
        raise ConfigError("--ema-rollout-policy ema with --offload-train: the old policy is not offloaded with the "
                          "rest of the train state; fix: drop --offload-train or use --ema-rollout-policy live")
    if ns.ema_rollout_policy != "ema":
        changed = [f"--{k.replace('_', '-')}" for k, v in EMA_DECAY_SCHEDULE_FLAGS.items() if getattr(ns, k) != v]
        if changed:
            raise ConfigError(f"{', '.join(changed)} shape the old policy's decay, which only --ema-rollout-policy ema "
                              f"keeps; fix: drop them or add --ema-rollout-policy ema (--loss-type nft)")
    if not nft and not ns.diffusion_nft_adaptive_weight:
        raise ConfigError(f"--no-diffusion-nft-adaptive-weight with --loss-type {ns.loss_type}: it shapes the nft loss "
                          f"only; fix: drop it")
    if ns.keep_zero_advantage_samples and ns.loss_type != "policy_loss":
        raise ConfigError(f"--keep-zero-advantage-samples with --loss-type {ns.loss_type}: only policy_loss drops "
                          f"zero-advantage samples; fix: drop it")


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
                 _dotted_paths, _prompt_data, _learning_rates, _microgroups, _target_modules, _dtypes,
                 _unimplemented_values, _gpu_memory, _edm_schedule, _weight_sync, _lora_ipc_weight_sync, _offload, _algorithm_flags,
                 _probe_sampling, _sft_media, check_capability_flags):
        rule(ns, family)


def _sft_media(ns: Namespace, family: FamilyFacts) -> None:
    if ns.loss_type == "sft_loss" and not family.encodes_media:
        raise ConfigError(f"--loss-type sft_loss: {family.name}'s sampler state holds audio latents beside the video's, "
                          f"which SFT's videos do not give (no encoder for them here); fix: train {family.name} with "
                          f"a rollout loss (the default GRPO, or nft)")


def _edm_schedule(ns: Namespace, family: FamilyFacts) -> None:
    """Cosmos2's Karras sigmas: a shift changes nothing, and the held last step cannot be trained."""
    if not family.edm_sigmas:
        return
    if ns.diffusion_shift is not None:
        raise ConfigError(f"--diffusion-shift {ns.diffusion_shift}: {family.name} samples the Karras (EDM) sigmas of "
                          f"its scheduler config, which no shift changes; fix: drop --diffusion-shift")
    last = ns.diffusion_num_steps - 1
    renoising = ns.loss_type in ("sft_loss", "nft")  # train at a sigma, not on a recorded SDE step
    if not renoising and last in trainable_steps(ns):
        raise ConfigError(f"step {last}, the last of --diffusion-num-steps {ns.diffusion_num_steps}, may be trained, "
                          f"but {family.name}'s schedule holds it at sigma_min (a step of length 0, no SDE noise); "
                          f"fix: end the trained steps earlier (e.g. a smaller --diffusion-sde-window-max-start) or "
                          f"raise --diffusion-num-steps")


def _probe_sampling(ns: Namespace, family: FamilyFacts) -> None:
    limit = getattr(ns, "diffusion_debug_probe_micro_batches", None)
    if limit is not None and not ns.diffusion_debug_mode:
        raise ConfigError(f"--diffusion-debug-probe-micro-batches {limit} without --diffusion-debug-mode: there is no "
                          f"parity probe to sample; fix: add --diffusion-debug-mode or drop the flag")
    if getattr(ns, "stop_on_parity_drift", False) and not ns.diffusion_debug_mode:
        raise ConfigError("--stop-on-parity-drift without --diffusion-debug-mode: there is no parity probe to read; "
                          "fix: add --diffusion-debug-mode or drop the flag")


def _lora_ipc_weight_sync(ns: Namespace, family: FamilyFacts) -> None:
    """miles-diffusion's flag: adapters only, through IPC handles to colocated engines. Here that is
    what a LoRA run with --colocate pushes (miles.ray.weight_sync_group.push_transport), so the flag
    asks for that layout and refuses one that would push otherwise."""
    if not getattr(ns, "lora_ipc_weight_sync", False):
        return
    lacking = [flag for flag, held in (("--use-lora", ns.use_lora), ("--colocate", ns.colocate),
                                       ("--weight-sync bucketed", ns.weight_sync == "bucketed")) if not held]
    if lacking:
        raise ConfigError(f"--lora-ipc-weight-sync pushes a LoRA run's adapters to colocated engines through IPC "
                          f"handles; this run lacks {', '.join(lacking)}; fix: add {' '.join(lacking)} or drop the flag")


def _weight_sync(ns: Namespace, family: FamilyFacts) -> None:
    size = ns.update_weight_buffer_size
    if size is None:
        return
    if ns.weight_sync != "bucketed":
        raise ConfigError(f"--update-weight-buffer-size {size} with --weight-sync {ns.weight_sync}: only bucketed "
                          f"sync uses a buffer; fix: drop --update-weight-buffer-size or use --weight-sync bucketed")
    if size <= 0:
        raise ConfigError(f"--update-weight-buffer-size {size}: a bucket needs at least one byte; fix: a positive "
                          f"number of bytes (default {DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE}, 512 MiB)")


def _unimplemented_values(ns: Namespace, family: FamilyFacts) -> None:
    """Values a flag accepts by type but the trainer cannot honour: refused, naming what works."""
    if ns.sequence_parallel_size != 1:
        raise ConfigError(f"--sequence-parallel-size {ns.sequence_parallel_size}: sequence parallelism is not "
                          f"implemented; use 1")
    if ns.rollout_num_gpus_per_engine != 1:
        raise ConfigError(f"--rollout-num-gpus-per-engine {ns.rollout_num_gpus_per_engine}: an engine runs on one "
                          f"device (no multi-GPU engine is implemented); use 1 and raise --rollout-num-gpus for "
                          f"more engines")


def _offload(ns: Namespace, family: FamilyFacts) -> None:
    """Offload frees a side's memory for the other side of a shared GPU; without one it would only
    cost copies, so the flag is refused rather than accepted and left to slow the run down."""
    for flag, on in (("--offload-train", ns.offload_train), ("--offload-rollout", ns.offload_rollout)):
        if not on:
            continue
        if not has_rollout_engines(ns):
            raise ConfigError(f"{flag}: this run has no rollout engines (--train-only / --loss-type {ns.loss_type}), "
                              f"so no engine shares the train GPUs; fix: drop {flag}")
        if not ns.colocate:
            raise ConfigError(f"{flag} without --colocate: train ranks and engines have GPUs of their own, so the "
                              f"memory offload frees would serve nobody; fix: add --colocate or drop {flag}")


def _gpu_memory(ns: Namespace, family: FamilyFacts) -> None:
    if getattr(ns, "gpu_memory_gb", None) is not None and ns.device == "cpu":
        raise ConfigError(f"--gpu-memory-gb {ns.gpu_memory_gb:g} with --device cpu: a CPU run has no GPU memory "
                          f"budget to check; fix: drop --gpu-memory-gb")
    if getattr(ns, "host_memory_gb", None) is not None and ns.device == "cpu":
        raise ConfigError(f"--host-memory-gb {ns.host_memory_gb:g} with --device cpu: the host plan covers GPU runs "
                          f"only; fix: drop --host-memory-gb")


def _dtypes(ns: Namespace, family: FamilyFacts) -> None:
    """Master weights in --param-dtype, train forwards in --compute-dtype, engines in --rollout-dtype.

    Parity (train forward == engine forward, bit for bit) needs both sides to run the same weights
    in the same dtype: the compute dtype must be the rollout dtype, and the master weights must
    hold the checkpoint at least as precisely as the engines do (float32, or the compute dtype).
    """
    if has_rollout_engines(ns) and ns.compute_dtype != ns.rollout_dtype:
        raise ConfigError(f"--compute-dtype {ns.compute_dtype} with --rollout-dtype {ns.rollout_dtype}: train "
                          f"forwards and engine forwards differ, so parity with the engines cannot be exact; "
                          f"fix: --rollout-dtype {ns.compute_dtype} (or --compute-dtype {ns.rollout_dtype})")
    # fp16 gradients underflow without a loss scaler, which this trainer has not; bf16 has fp32's
    # exponent range (no scaler needed), and a master copy is best kept in float32
    for flag, value, fix in (("--compute-dtype", ns.compute_dtype, "bfloat16"),
                             ("--param-dtype", ns.param_dtype, "float32 (or bfloat16)")):
        if value == "float16":
            raise ConfigError(f"{flag} float16: training in fp16 needs a gradient scaler, which this trainer does "
                              f"not have; fix: {flag} {fix}")
    if ns.param_dtype not in ("float32", ns.compute_dtype):
        other = (f"--param-dtype {ns.compute_dtype}" if ns.compute_dtype != "float32" else
                 f"--compute-dtype {ns.param_dtype} --rollout-dtype {ns.param_dtype}")
        raise ConfigError(f"--param-dtype {ns.param_dtype} with --compute-dtype {ns.compute_dtype}: master weights "
                          f"in {ns.param_dtype} round what a {ns.compute_dtype} forward reads; fix: --param-dtype "
                          f"float32 (or {other})")


def _run_length(ns: Namespace, family: FamilyFacts) -> None:
    if (ns.num_rollout is None) == (ns.num_epoch is None):
        given = "neither was given" if ns.num_rollout is None else (
            f"both were given (--num-rollout {ns.num_rollout}, --num-epoch {ns.num_epoch})")
        raise ConfigError(f"exactly one of --num-rollout or --num-epoch is required, {given}; fix: keep one")


def _checkpointing(ns: Namespace, family: FamilyFacts) -> None:
    if ns.save_interval is not None and not ns.save:
        raise ConfigError(f"--save-interval {ns.save_interval} needs --save DIR; fix: add --save or drop "
                          f"--save-interval")
    if ns.keep_last is not None and not ns.save:
        raise ConfigError(f"--keep-last {ns.keep_last} needs --save DIR; fix: add --save or drop --keep-last")
    if ns.keep_every is not None and ns.keep_last is None:
        raise ConfigError(f"--keep-every {ns.keep_every} needs --keep-last N (without it every checkpoint is kept); "
                          f"fix: add --keep-last or drop --keep-every")
    if ns.load_anyway and not ns.load:
        raise ConfigError("--load-anyway needs --load DIR; fix: add --load or drop --load-anyway")


def _lora_flags(ns: Namespace, family: FamilyFacts) -> None:
    given = [flag for flag, value in (("--lora-rank", ns.lora_rank), ("--lora-alpha", ns.lora_alpha),
                                      ("--lora-target-modules", ns.lora_target_modules),
                                      ("--lora-init-weights", None if ns.lora_init_weights == "gaussian" else 1))
             if value is not None]
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
    if ns.rm_type == "custom" and not ns.custom_rm_path:
        raise ConfigError("--rm-type custom needs --custom-rm-path pkg.mod:fn; fix: add it")
    if ns.rm_type and ns.rm_type != "custom" and ns.custom_rm_path:
        raise ConfigError(f"--rm-type {ns.rm_type} and --custom-rm-path {ns.custom_rm_path} both given; "
                          f"fix: keep one (or --rm-type custom)")
    if ns.loss_type != "sft_loss" and not (ns.rm_type or ns.custom_rm_path):
        raise ConfigError(f"--loss-type {ns.loss_type} needs a reward; fix: add --rm-type NAME or "
                          f"--custom-rm-path pkg.mod:fn")


def _dotted_paths(ns: Namespace, family: FamilyFacts) -> None:
    for flag, value in (("--custom-rm-path", ns.custom_rm_path),
                        ("--custom-loss-function-path", ns.custom_loss_function_path)):
        if value and not DOTTED_PATH.match(value):
            raise ConfigError(f"{flag} {value!r} is not a pkg.mod:fn or pkg.mod.fn path; fix: name the "
                              f"function by its import path")


def _prompt_data(ns: Namespace, family: FamilyFacts) -> None:
    if not ns.prompt_data:
        raise ConfigError("--prompt-data is required (a JSONL file of prompts, or SFT items); fix: add "
                          "--prompt-data FILE.jsonl")


def _learning_rates(ns: Namespace, family: FamilyFacts) -> None:
    if ns.min_lr > ns.lr:
        raise ConfigError(f"--min-lr {ns.min_lr} > --lr {ns.lr}; fix: lower --min-lr")
    if ns.min_lr > 0 and ns.lr_decay_style == "constant":
        raise ConfigError(f"--min-lr {ns.min_lr:g} with --lr-decay-style constant: a constant schedule never "
                          f"decays to a floor; fix: --lr-decay-style linear or cosine, or drop --min-lr")


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
