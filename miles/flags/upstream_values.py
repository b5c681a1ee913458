"""miles-diffusion's flag names and values that map onto this project's, beyond one-to-one renames
(those are in `miles.flags.public_flags`): a value with a meaning here maps onto ours, any other
value of the same flag is refused at parse time in one line naming what runs here instead. The
whole vocabulary, with the flags that have no counterpart, is `miles.flags.flag_vocabulary`.
Torch-free.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

# miles-diffusion's default rollout functions: its sglang engines' rollout (here: this project's own
# engines) and its SFT data path (here: --train-only, SFT items read by the train ranks)
ENGINE_ROLLOUT = "miles.rollout.sglang_diffusion_rollout.generate_rollout"
SFT_ROLLOUT = "miles.rollout.sft_rollout.generate_rollout"
ROLLOUT_FUNCTIONS = {ENGINE_ROLLOUT: "engines", SFT_ROLLOUT: "sft"}
# miles-diffusion's SFT plumbing, flag -> its own SFT function: here the one SFT of --loss-type sft_loss
SFT_HOOKS = {
    "--custom-convert-samples-to-train-data-path": "miles.rollout.sft_rollout.convert_samples_to_train_data",
    "--custom-rollout-log-function-path": "miles.rollout.sft_rollout.log_rollout_data",
    "--custom-prepare-train-batch-path": "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch",
}
SFT_LOSS_FUNCTION = "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"
STEP_STRATEGY_HUB = "miles.rollout.step_strategy_hub."  # its built-in strategies, ours by the same names
IMAGE_TASK, VIDEO_TASK = "t2i", "t2v"


def _rollout_function(value: str) -> str:
    if value not in ROLLOUT_FUNCTIONS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a rollout function of its own does not run here; rollout is this project's engines "
            f"({ENGINE_ROLLOUT}) or, for SFT, the train ranks reading the items ({SFT_ROLLOUT}); a custom reward is "
            f"--custom-rm-path")
    return ROLLOUT_FUNCTIONS[value]


def _exactly(expected: str, what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value != expected:
            raise argparse.ArgumentTypeError(f"{value!r}: only miles-diffusion's own {expected} has a counterpart "
                                             f"here ({what}); a function of your own does not run here")
        return value
    return check


def _one_only(what: str) -> Callable[[str], int]:
    def check(value: str) -> int:
        from miles.flags.value_types import positive_int

        number = positive_int(value)
        if number != 1:
            raise argparse.ArgumentTypeError(f"{number}: {what}; fix: 1")
        return number
    return check


def _single_shift(value: str) -> float:
    from miles.flags.value_types import positive_float

    if "=" in value:
        raise argparse.ArgumentTypeError(f"{value!r}: a shift per stream (video, audio) has no counterpart here, "
                                         f"where one schedule serves every latent; give one number")
    return positive_float(value)


def _lora_merge_mode(value: str) -> str:
    if value != "dynamic":
        raise argparse.ArgumentTypeError(f"{value!r}: engines here always apply PEFT's adapters unmerged, as the "
                                         f"train ranks do (merging rounds differently); fix: dynamic or drop it")
    return value


def add_upstream_aliases(alias: Callable[..., None]) -> None:
    """The value-mapped names, through public_flags' `alias(flag, targets, help, **kwargs)`."""
    from miles.flags.value_types import dtype_word, non_negative_float, positive_float, positive_int

    alias("--diffusion-flow-shift", ("diffusion_shift",), type=positive_float, metavar="X",
          help="the sampling schedule's shift: --diffusion-shift")
    alias("--fsdp-flow-shift", ("diffusion_shift",), convert=_single_shift, metavar="X",
          help="SFT's training sigmas' shift (the same schedule here): --diffusion-shift")
    alias("--ulysses-degree", ("sequence_parallel_size",), type=positive_int, metavar="N",
          help="Ulysses sequence parallel degree: --sequence-parallel-size")
    alias("--diffusion-true-cfg-scale", ("diffusion_true_cfg_scale",), type=non_negative_float, metavar="X",
          help="Qwen-Image's true CFG scale, its classifier-free guidance: --diffusion-guidance-scale (qwen_image only)")
    alias("--diffusion-task", ("diffusion_task",), metavar="t2i|t2v",
          help="the family's task: t2i for an image family, t2v for a video family (the only one each runs here)")
    alias("--rollout-function-path", ("rollout_function",), convert=_rollout_function, metavar="PATH",
          help=f"{ENGINE_ROLLOUT}: this project's engines (the default); {SFT_ROLLOUT}: --train-only")
    for flag, function in SFT_HOOKS.items():
        alias(flag, (flag.lstrip("-").replace("-", "_"),), convert=_exactly(function, "--loss-type sft_loss's SFT"),
              metavar="PATH", help=f"{function}: the SFT of --loss-type sft_loss")
    alias("--sft-encoder-checkpoint", ("sft_encoder_checkpoint",), metavar="DIR",
          help="the checkpoint whose VAE and text encoder encode SFT items: here --hf-checkpoint's own (the same path)")
    alias("--sft-frame-stride", ("sft_frame_stride",), convert=_one_only(
          "SFT items are read with every frame of their strip here; make the items at the frame rate to train"),
          metavar="1", help="SFT video frame stride: 1, every frame of an item (items are made at the rate to train)")
    alias("--rollout-weights", ("ema_rollout_policy",), choices=("ema", "live"),
          help="weights the engines sample with: --ema-rollout-policy")
    alias("--pickscore-reward-colocate", ("colocate_reward",), nargs=0, const=True, help="--colocate-reward")
    alias("--diffusion-fps", ("diffusion_fps",), type=positive_float, metavar="FPS",
          help="LTX's frame rate, which its rope reads: 24 here, LTX2Pipeline's")
    alias("--n-samples-per-eval-prompt", ("n_samples_per_eval_prompt",), convert=_one_only(
          "eval here samples one deterministic (all-ODE) sample per eval prompt"), metavar="1",
          help="eval samples per prompt: 1 here, a deterministic sample")
    alias("--rollout-return-full-trajectory", ("rollout_return_full_trajectory",), nargs=0, const=True,
          help="engines return every step's latents: here they always do (a trajectory holds all N+1)")
    alias("--sglang-lora-merge-mode", ("sglang_lora_merge_mode",), convert=_lora_merge_mode, metavar="dynamic",
          help="engines apply LoRA adapters unmerged: here they always do, as the train ranks")
    alias("--sglang-dit-precision", ("rollout_dtype",), convert=dtype_word, metavar="fp16|bf16|fp32",
          help="the engines' transformer dtype: --rollout-dtype")
    alias("--lr-warmup-iters", ("lr_warmup_steps",), type=positive_int, metavar="N", help="--lr-warmup-steps")
    alias("--wandb-team", ("wandb_entity",), metavar="ENTITY",
          help="the wandb entity (team) the run goes to: $WANDB_ENTITY's place")
    alias("--disable-wandb-random-suffix", ("wandb_random_suffix",), nargs=0, const=False,
          help="wandb run names without a random suffix: here they never have one (--wandb-run-name as given)")


def normalize_upstream_values(ns: argparse.Namespace) -> None:
    """The shapes miles-diffusion writes values in, as ours: a comma list of components, its step
    strategy hub's dotted names, its SFT loss path, the SFT rollout, an SDE window range."""
    if getattr(ns, "update_weight_target_module", None):
        ns.update_weight_target_module = [m for word in ns.update_weight_target_module
                                          for m in word.split(",") if m]
    strategy = getattr(ns, "diffusion_step_strategy_path", None)
    if strategy and strategy.startswith(STEP_STRATEGY_HUB):
        from miles.flags.batch_rules import BUILTIN_STEP_STRATEGIES

        name = strategy[len(STEP_STRATEGY_HUB):]
        if name in BUILTIN_STEP_STRATEGIES:
            ns.diffusion_step_strategy_path = name
    if getattr(ns, "custom_loss_function_path", None) == SFT_LOSS_FUNCTION:
        ns.custom_loss_function_path = None  # miles-diffusion's SFT loss is --loss-type sft_loss's own
        ns.upstream_sft_loss = True
    if getattr(ns, "rollout_function", None) == "sft":
        ns.train_only = True
    _resolve_window_range(ns)


def _resolve_window_range(ns: argparse.Namespace) -> None:
    window = getattr(ns, "diffusion_sde_window_range", None)
    if window is None:
        return
    from miles.flags.batch_rules import ConfigError

    del ns.diffusion_sde_window_range  # what it says is in the min and max starts below
    lo, hi = window
    size = ns.diffusion_num_sde_steps or max(1, int(ns.diffusion_num_steps * ns.diffusion_timestep_fraction))
    if hi - lo < size:
        raise ConfigError(f"--diffusion-sde-window-range {lo},{hi} holds {hi - lo} step(s), fewer than the window's "
                          f"{size} (--diffusion-num-sde-steps); fix: widen the range or shrink the window")
    ns.diffusion_sde_window_min_start, ns.diffusion_sde_window_max_start = lo, hi - size


def upstream_attributes(ns: argparse.Namespace) -> dict[str, Any]:
    """The values only miles-diffusion's names set (for the rules of miles.flags.capability_rules)."""
    names = ("diffusion_true_cfg_scale", "diffusion_task", "sft_encoder_checkpoint", "diffusion_fps",
             *(flag.lstrip("-").replace("-", "_") for flag in SFT_HOOKS))
    return {name: getattr(ns, name) for name in names if getattr(ns, name, None) is not None}
