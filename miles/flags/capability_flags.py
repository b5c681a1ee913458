"""Flags of capabilities miles-diffusion's launch scripts use, under miles-diffusion's own names
(the same name, the same meaning): gradient reduce dtype, hybrid sharding, the SDE steps a random
strategy may draw, recomputed old log-probs, the engines' patch group, the SDE window's lowest
start, wandb image logging and how many frames PickScore reads. Their rules are in
`miles.flags.capability_rules`. Torch-free.
"""

from __future__ import annotations

import argparse

# upstream's --rollout-patch-group: the engine patches that make an sglang engine run the op
# sequence the trainer runs, by the family they patch. Here engines and train ranks call one
# forward (DiffusionModel.velocity), so a group only has to name the run's family.
PATCH_GROUPS: dict[str, tuple[str, ...]] = {
    "qwen_image": ("qwen_image",), "wan": ("wan2_2",), "ltx": ("ltx2", "ltx"), "cosmos3_bitwise": ("cosmos3",),
    "qwen_image21": (),  # Qwen-Image 2.1: no family of this project runs it
}


def step_list(value: str) -> list[int]:
    """'1,2,3' (or '1 2 3') -> [1, 2, 3]: distinct steps, at least one, none negative."""
    try:
        steps = [int(part) for part in str(value).replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps like '1,2,3', got {value!r}") from None
    if not steps or any(s < 0 for s in steps) or len(set(steps)) != len(steps):
        raise argparse.ArgumentTypeError(f"expected distinct steps >= 0 like '1,2,3', got {value!r}")
    return steps


def reduce_dtype(word: str) -> str:
    from miles.flags.value_types import dtype_word

    name = dtype_word(word)
    if name == "float16":
        raise argparse.ArgumentTypeError("fp16 gradients underflow without a gradient scaler, which this trainer "
                                         "does not have; use fp32 or bf16")
    return name


def add_capability_flags(parser: argparse.ArgumentParser) -> None:
    from miles.flags.value_types import non_negative_int, positive_int

    g = parser.add_argument_group(
        "miles-diffusion capabilities", "flags of miles-diffusion's recipes with the same name and meaning here")
    g.add_argument("--fsdp-reduce-dtype", type=reduce_dtype, default=None, metavar="fp32|bf16",
                   help="dtype gradients are reduce-scattered (fsdp) or all-reduced (dp) in across the train ranks, "
                        "then kept in --param-dtype; unset: --param-dtype")
    g.add_argument("--dp-replicate-size", type=positive_int, default=1,
                   help="with --train-backend fsdp: hybrid sharding (HSDP) on a 2-D mesh, the train ranks in this "
                        "many replicas, each replica sharding the weights over its ranks (ranks / this); gradients "
                        "are averaged over every rank as before. 1: shard over all ranks")
    g.add_argument("--diffusion-sde-candidate-steps", type=step_list, default=None, metavar="S1,S2,...",
                   help="epoch_global_random_choice: the steps it draws the trained ones from (unset: the first "
                        "int(steps x --diffusion-timestep-fraction))")
    g.add_argument("--diffusion-sde-window-min-start", type=non_negative_int, default=0,
                   help="sde_window: the window starts at a step in this..--diffusion-sde-window-max-start")
    g.add_argument("--diffusion-recompute-old-log-prob", action=argparse.BooleanOptionalAction, default=False,
                   help="policy_loss: the PPO ratio's old log-probs are recomputed by the train ranks, on the "
                        "weights the rollout was sampled with, before the rollout's first optimizer step, instead "
                        "of the engines' (equal bit for bit when parity holds)")
    g.add_argument("--rollout-patch-group", choices=tuple(PATCH_GROUPS), default=None,
                   help="miles-diffusion's engine patches that make sglang run the trainer's ops; here engines and "
                        "train ranks share one forward, so the group only has to name this run's family")
    g.add_argument("--wandb-log-num-images", type=non_negative_int, default=0,
                   help="with --use-wandb: log this many of a rollout's samples to wandb as images (0: none)")
    g.add_argument("--wandb-log-image-interval", type=positive_int, default=1,
                   help="with --wandb-log-num-images: every this many rollouts")
    g.add_argument("--pickscore-num-frames", type=positive_int, default=None,
                   help="frames of a video PickScore scores (spread evenly, first and last included), their "
                        "scores averaged; unset: 4")
