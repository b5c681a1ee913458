"""Flow-GRPO with an OCR reward on Stable Diffusion 3.5 (LoRA, KL to the LoRA base).

What it trains:
    A LoRA on the SD3.5 transformer so that the word quoted in a prompt ('a sign that says
    "OPEN"') comes out legible. Each image is read by a packaged OCR model and scored 1 minus
    the normalised edit distance to the quoted word (`--rm-type ocr`). A KL term to the frozen
    base weights under the LoRA keeps the policy near the base model. Two variants, chosen with
    --model-name: `sd3.5-medium` (default) and `sd3.5-large`.

Prerequisites:
    --scale full: the variant's released diffusers checkpoint under --model-dir, i.e.
    `<model-dir>/stable-diffusion-3.5-medium` or `<model-dir>/stable-diffusion-3.5-large`.
    Nothing else: `prepare()` writes the OCR prompts, and the OCR model ships in its package.

GPU layout (--scale full, 1 node, 2 GPUs):
    GPU 0, 1   one train rank + one rollout engine each (colocated), 2 data-parallel ranks
    CPU        OCR reward workers, no GPU

Scales (--scale):
    full       the released checkpoint, 512 px, 16 prompts x 16 samples, 2 GPUs
               eval: 256 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size sd3 (fills a GPU), 256 px, small batch, same 2-GPU layout
    cpu-proxy  our tiny sd3, 64 px, 2 CPU train ranks; two rollouts in about a minute

Example:
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --model-name sd3.5-large --num-rollout 200
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass, field
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "sd3"
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80


@dataclass(frozen=True)
class _Recipe:
    """What differs between the SD3.5 variants, at every scale."""

    checkpoint: str  # released checkpoint folder under --model-dir (--scale full)
    guidance_scale: float
    lora_rank: int
    lr: float


_RECIPES: dict[str, _Recipe] = {
    "sd3.5-medium": _Recipe(checkpoint="stable-diffusion-3.5-medium", guidance_scale=4.5, lora_rank=32, lr=3e-4),
    "sd3.5-large": _Recipe(checkpoint="stable-diffusion-3.5-large", guidance_scale=3.5, lora_rank=64, lr=1e-4),
}


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    resolution: int
    sde_window_max_start: int  # the SDE window of 2 trained steps starts in 0..sde_window_max_start
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward


_SCALES: dict[str, _Scale] = {  # the OCR reward workers are CPU actors at every scale
    "full": _Scale(
        U.FULL_SCALE, train_ranks=2, resolution=512, num_steps=10, sde_window_max_start=3, rollout_batch_size=16,
        n_samples_per_prompt=16, tile_samples=8, rm_num_workers=4, num_prompts=2000, num_rollout=400,
        eval_interval=30, eval_prompts=256, save_interval=20,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=2, resolution=256, num_steps=10, sde_window_max_start=3, rollout_batch_size=4,
        n_samples_per_prompt=8, tile_samples=4, rm_num_workers=2, num_prompts=64, num_rollout=4,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, resolution=64, num_steps=6, sde_window_max_start=2, rollout_batch_size=2,
        n_samples_per_prompt=4, tile_samples=2, rm_num_workers=1, num_prompts=16, num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    model_name: Literal["sd3.5-medium", "sd3.5-large"] = field(
        default="sd3.5-medium",
        metadata={"help": "SD3.5 variant: its released checkpoint (--scale full), guidance, LoRA rank and LR."},
    )
    scale: Literal["full", "gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: the released checkpoint on 2 GPUs; gpu-proxy: our proxy-size sd3 on the same "
        "GPUs; cpu-proxy: our tiny sd3 on CPU slots, two rollouts in about a minute.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)
    kl_beta: float = field(default=0.04, metadata={"help": "Weight of the KL to the LoRA base (--diffusion-kl-beta)."})


def prepare(args: ScriptArgs) -> U.Assets:
    """Make (once) the checkpoint and the OCR prompt files; a dry run only names their paths."""
    recipe = U.select_recipe(_RECIPES, args.model_name)
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=recipe.checkpoint, prompts="ocr")


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    recipe, scale = U.select_recipe(_RECIPES, args.model_name), _SCALES[args.scale]
    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB)

    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout, metadata=True) + (
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        f"--diffusion-sde-type sde --diffusion-noise-level 0.7 --diffusion-guidance-scale {recipe.guidance_scale} "
        "--diffusion-max-sequence-length 128 "  # flow_grpo's T5 length (train_sd3.py)
    )

    grpo_args = (
        "--loss-type policy_loss --advantage-estimator grpo "
        "--diffusion-clip-range 1e-4 --diffusion-adv-clip-max 5.0 "
        f"--diffusion-kl-beta {args.kl_beta} --diffusion-kl-reference lora_base "
        "--num-steps-per-rollout 2 "
    )

    optimizer_args = U.optimizer_args(lr=recipe.lr)

    lora_args = f"--use-lora --lora-rank {recipe.lora_rank} --lora-alpha {recipe.lora_rank} "

    reward_args = U.cpu_reward_args("ocr", scale.rm_num_workers)

    # the engines sample in microgroups of the tile, so each train forward is one the engines ran
    perf_args = (U.tile_args(scale.tile_samples) + f"--rollout-microgroup-size {scale.tile_samples} "
                 + U.gradient_checkpointing_args(scale))

    job.execute_train(rollout_args=rollout_args, grpo_args=grpo_args, optimizer_args=optimizer_args,
                      lora_args=lora_args, reward_args=reward_args, perf_args=perf_args)


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
