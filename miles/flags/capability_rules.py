"""Rules of the flags miles-diffusion's recipes bring (miles.flags.capability_flags and the
value-mapped names of miles.flags.upstream_values): each value is honoured or refused at parse
time with one line naming the fix. Torch-free.
"""

from __future__ import annotations

from argparse import Namespace

from miles.flags.batch_rules import ConfigError, num_trained_steps, train_gpus
from miles.flags.capability_flags import PATCH_GROUPS
from miles.diffusion_facts.families import FamilyFacts
from miles.flags.upstream_values import IMAGE_TASK, SFT_HOOKS, VIDEO_TASK

LTX_FRAME_RATE = 24.0  # LTX2Pipeline's frame_rate, which the ltx2 family's rope reads


def check_capability_flags(ns: Namespace, family: FamilyFacts) -> None:
    for rule in (_reduce_dtype, _replicas, _candidate_steps, _window_start, _recompute_old_log_prob,
                 _patch_group, _wandb_images, _pickscore_frames, _true_cfg, _task, _frame_rate, _sft_plumbing):
        rule(ns, family)


def _reduce_dtype(ns: Namespace, family: FamilyFacts) -> None:
    dtype = ns.fsdp_reduce_dtype
    if dtype is not None and dtype != ns.param_dtype and ns.train_backend != "fsdp":
        raise ConfigError(f"--fsdp-reduce-dtype {dtype} with --train-backend {ns.train_backend}: the data-parallel "
                          f"backend all-reduces gradients in --param-dtype {ns.param_dtype}; fix: --train-backend "
                          f"fsdp, or drop --fsdp-reduce-dtype")


def _replicas(ns: Namespace, family: FamilyFacts) -> None:
    replicas, ranks = ns.dp_replicate_size, train_gpus(ns)
    if replicas == 1:
        return
    if ns.train_backend != "fsdp":
        raise ConfigError(f"--dp-replicate-size {replicas} shards within replicas, which needs --train-backend fsdp "
                          f"(this run: {ns.train_backend}, every rank holds the whole model); fix: add "
                          f"--train-backend fsdp or drop --dp-replicate-size")
    if ranks % replicas:
        raise ConfigError(f"--dp-replicate-size {replicas} does not divide the {ranks} train ranks (--actor-num-nodes "
                          f"x --actor-num-gpus-per-node); fix: a divisor of {ranks}")


def _candidate_steps(ns: Namespace, family: FamilyFacts) -> None:
    steps = ns.diffusion_sde_candidate_steps
    if steps is None:
        return
    if ns.diffusion_step_strategy_path != "epoch_global_random_choice":
        raise ConfigError(f"--diffusion-sde-candidate-steps {_csv(steps)} is what epoch_global_random_choice draws "
                          f"from, not {ns.diffusion_step_strategy_path}; fix: --diffusion-step-strategy-path "
                          f"epoch_global_random_choice, or drop the candidates")
    outside = [s for s in steps if s >= ns.diffusion_num_steps]
    if outside:
        raise ConfigError(f"--diffusion-sde-candidate-steps {_csv(steps)}: step(s) {_csv(outside)} outside the "
                          f"{ns.diffusion_num_steps} steps of --diffusion-num-steps; fix: steps below "
                          f"{ns.diffusion_num_steps}")
    trained = num_trained_steps(ns)
    if trained > len(steps):
        raise ConfigError(f"--diffusion-num-sde-steps {trained} > the {len(steps)} candidate step(s) "
                          f"{_csv(steps)}; fix: more candidates or fewer SDE steps")


def _window_start(ns: Namespace, family: FamilyFacts) -> None:
    lo, hi = ns.diffusion_sde_window_min_start, ns.diffusion_sde_window_max_start
    if lo and ns.diffusion_step_strategy_path != "sde_window":
        raise ConfigError(f"--diffusion-sde-window-min-start {lo} applies to the sde_window strategy only, not "
                          f"{ns.diffusion_step_strategy_path}; fix: drop it")
    if lo > hi:
        raise ConfigError(f"--diffusion-sde-window-min-start {lo} > --diffusion-sde-window-max-start {hi}; fix: a "
                          f"min start at most the max start")


def _recompute_old_log_prob(ns: Namespace, family: FamilyFacts) -> None:
    if ns.diffusion_recompute_old_log_prob and ns.loss_type != "policy_loss":
        raise ConfigError(f"--diffusion-recompute-old-log-prob: --loss-type {ns.loss_type} has no PPO ratio and so "
                          f"no old log-probs; fix: drop the flag")


def _patch_group(ns: Namespace, family: FamilyFacts) -> None:
    group = ns.rollout_patch_group
    if group is None or family.name in PATCH_GROUPS[group]:
        return
    runs = f"the {'/'.join(PATCH_GROUPS[group])} family" if PATCH_GROUPS[group] else "a model no family here runs"
    raise ConfigError(f"--rollout-patch-group {group} patches {runs}, this run trains {family.name}; engines and "
                      f"train ranks share one forward here, so no patch is needed; fix: drop the flag, or name "
                      f"this family's group")


def _wandb_images(ns: Namespace, family: FamilyFacts) -> None:
    if ns.wandb_log_num_images and not ns.use_wandb:
        raise ConfigError(f"--wandb-log-num-images {ns.wandb_log_num_images} without --use-wandb: there is no wandb "
                          f"run to log them to (the samples are in <run-dir>/last_rollout.png); fix: add --use-wandb "
                          f"or drop it")


def _pickscore_frames(ns: Namespace, family: FamilyFacts) -> None:
    frames = ns.pickscore_num_frames
    if frames is not None and ns.rm_type != "pickscore":
        raise ConfigError(f"--pickscore-num-frames {frames} with --rm-type {ns.rm_type or ns.custom_rm_path}: only "
                          f"the pickscore reward reads it; fix: drop it")


def _true_cfg(ns: Namespace, family: FamilyFacts) -> None:
    """Qwen-Image's true_cfg_scale is its classifier-free guidance; here that is the guidance scale."""
    scale = getattr(ns, "diffusion_true_cfg_scale", None)
    if scale is None:
        return
    if family.name != "qwen_image":
        raise ConfigError(f"--diffusion-true-cfg-scale {scale:g}: true CFG is Qwen-Image's; {family.name}'s "
                          f"guidance is --diffusion-guidance-scale; fix: use that")
    ns.diffusion_guidance_scale = scale


def _task(ns: Namespace, family: FamilyFacts) -> None:
    task = getattr(ns, "diffusion_task", None)
    runs = VIDEO_TASK if family.is_video else IMAGE_TASK
    if task is not None and task != runs:
        raise ConfigError(f"--diffusion-task {task}: {family.name} runs {runs} here (text to "
                          f"{'video' if family.is_video else 'image'}), no other task; fix: --diffusion-task {runs} "
                          f"or drop it")


def _frame_rate(ns: Namespace, family: FamilyFacts) -> None:
    fps = getattr(ns, "diffusion_fps", None)
    if fps is None:
        return
    if family.name not in ("ltx2", "ltx"):
        raise ConfigError(f"--diffusion-fps {fps:g}: {family.name}'s forward reads no frame rate (only LTX's rope "
                          f"does); fix: drop it")
    if fps != LTX_FRAME_RATE:
        raise ConfigError(f"--diffusion-fps {fps:g}: {family.name} samples at {LTX_FRAME_RATE:g} fps here, "
                          f"LTX2Pipeline's; fix: --diffusion-fps {LTX_FRAME_RATE:g} or drop it")


def _sft_plumbing(ns: Namespace, family: FamilyFacts) -> None:
    given = [flag for flag in SFT_HOOKS if getattr(ns, flag.lstrip("-").replace("-", "_"), None)]
    given += ["--sft-encoder-checkpoint"] if getattr(ns, "sft_encoder_checkpoint", None) else []
    given += ["--custom-loss-function-path (miles-diffusion's SFT loss)"] if getattr(ns, "upstream_sft_loss", False) else []
    given += ["--rollout-function-path (its SFT rollout)"] if getattr(ns, "rollout_function", None) == "sft" else []
    if given and ns.loss_type != "sft_loss":
        raise ConfigError(f"{given[0]} is SFT plumbing, and this run's --loss-type is {ns.loss_type}; fix: "
                          f"--loss-type sft_loss, or drop it")
    encoder = getattr(ns, "sft_encoder_checkpoint", None)
    if encoder and encoder != ns.hf_checkpoint:
        raise ConfigError(f"--sft-encoder-checkpoint {encoder}: SFT items are encoded here by --hf-checkpoint's own VAE "
                          f"and text encoder ({ns.hf_checkpoint}); fix: give the same path or drop it")


def _csv(steps) -> str:
    return ",".join(map(str, steps))
