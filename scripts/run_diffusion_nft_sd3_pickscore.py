"""DiffusionNFT with a PickScore reward on Stable Diffusion 3.5 Medium (full finetune, old policy):
DiffusionNFT's `sd3_pickscore` config (NVlabs/DiffusionNFT config/nft.py; docs/algorithms.md's table).

What it trains:
    The whole SD3.5-Medium transformer with the DiffusionNFT objective (`--loss-type nft`).
    Each sample's advantage (reward minus its prompt's mean, over the batch-wide std: `global_std`)
    becomes an optimality weight r in [0, 1]; the loss (beta 1.0) pulls an implicit positive policy
    toward the good samples and pushes a negative one away from the bad ones, on noised versions
    of the generated images. Sampling and training are CFG-free (guidance 1.0, as the reference
    samples). NFT needs no sampler log-probs, so rollouts are deterministic, and every sample trains
    the reference's timestep fraction of its steps (0.99 of 10: steps 0-8), one optimizer step per
    rollout. Rollouts are sampled from DiffusionNFT's old policy (`--ema-rollout-policy ema`), a
    ramped EMA of the trained weights (decay min(0.001 x step, 0.5)), kept and checkpointed.
    The reward is PickScore, a CLIP-style human-preference model.
    Deliberate differences from train_nft_sd3.py: the sampler is the deterministic Euler ODE, the
    nearest of ours to the reference's second-order `dpm2` solver (both deterministic; dpm2 reaches
    a slightly different image from the same noise in 10 steps); a full finetune (the reference
    trains LoRA, and its KL to the LoRA base therefore does not apply: --diffusion-kl-beta is 0, and
    the learning rate is 3e-5, not LoRA's 3e-4); no second, evaluation-only EMA (the reference's
    decay-0.9 copy; it would not fit beside the old policy in 80 GB); 16 prompts x 8 samples per
    rollout on 2 train GPUs, not 48 x 24 on 8; the trained steps are visited in the same order for
    every sample (the reference shuffles them per sample; the gradient is their sum either way).

Prerequisites:
    --scale full: `<model-dir>/stable-diffusion-3.5-medium` (diffusers layout) and
    `<model-dir>/PickScore_v1` (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 3 GPUs):
    GPU 0, 1  one train rank + one rollout engine each (colocated), 2 data-parallel ranks
    GPU 2     PickScore: 2 reward workers at 0.5 GPU each

Scales (--scale):
    full       SD3.5-Medium and PickScore, 512 px, 16 prompts x 8 samples, 3 GPUs
               eval: 256 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size sd3 and a tiny CLIP, 256 px, same 3-GPU layout
    cpu-proxy  our tiny sd3 and tiny CLIP, 64 px, 2 CPU train ranks, CPU reward actor

Example:
    python3 scripts/run_diffusion_nft_sd3_pickscore.py
    python3 scripts/run_diffusion_nft_sd3_pickscore.py --num-rollout 100 --extra-args "--ema-decay-max 0.9"
    python3 scripts/run_diffusion_nft_sd3_pickscore.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_nft_sd3_pickscore.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "sd3"
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80
RELEASED_CHECKPOINT = "stable-diffusion-3.5-medium"  # under --model-dir (--scale full), beside PickScore_v1


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    resolution: int
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward


_SCALES: dict[str, _Scale] = {  # num_steps: the first int(num_steps x 0.99) of them are trained
    "full": _Scale(
        U.FULL_SCALE, train_ranks=2, resolution=512, num_steps=10, rollout_batch_size=16, n_samples_per_prompt=8,
        # tile 4: the engines sample microgroups of 4 (8 sequences per guided forward), which fits the H100
        tile_samples=4, reward_gpus=1, rm_num_workers=2, num_prompts=4000, num_rollout=300, eval_interval=30, eval_prompts=256,
        save_interval=20,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=2, resolution=256, num_steps=10, rollout_batch_size=4, n_samples_per_prompt=8,
        tile_samples=4, reward_gpus=1, rm_num_workers=2, num_prompts=64, num_rollout=4,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, resolution=64, num_steps=6, rollout_batch_size=2, n_samples_per_prompt=4,
        tile_samples=2, reward_gpus=0, rm_num_workers=1, num_prompts=16, num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: SD3.5-Medium and PickScore on 3 GPUs; gpu-proxy: our proxy-size sd3 and a tiny "
        "CLIP on the same GPUs; cpu-proxy: our tiny sd3 on CPU slots.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)


def prepare(args: ScriptArgs) -> U.Assets:
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=RELEASED_CHECKPOINT, pickscore=True)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB)

    # DiffusionNFT's sd3_pickscore sampling: CFG-free (guidance_scale 1.0), deterministic (its dpm2
    # solver; ours the Euler ODE), the first int(steps x 0.99) steps of each sample trained
    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout) + (
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-nft-timestep-fraction 0.99 "
        "--diffusion-step-strategy-path sde_window "
        "--diffusion-sde-type ode --diffusion-guidance-scale 1.0 "
        "--diffusion-max-sequence-length 128 "  # DiffusionNFT's T5 length (train_nft_sd3.py)
    )

    # DiffusionNFT's sd3_pickscore: beta 1, global std, adv clip 5, one optimizer step per epoch,
    # rollouts from an old policy that follows the trained weights by a ramped EMA (decay_type 1:
    # min(0.001 x step, 0.5))
    grpo_args = (
        "--loss-type nft --diffusion-nft-beta 1.0 --advantage-estimator grpo --globalize-reward-std "
        "--diffusion-adv-clip-max 5.0 --ema-rollout-policy ema --ema-decay-ramp 0.001 --ema-decay-max 0.5 "
        "--num-steps-per-rollout 1 "
    )

    optimizer_args = U.optimizer_args(lr="3e-5")

    lora_args = ""  # full finetune

    # the engines sample in microgroups of the tile, so each train forward is one the engines ran
    perf_args = (U.tile_args(scale.tile_samples) + f"--rollout-microgroup-size {scale.tile_samples} "
                 + U.gradient_checkpointing_args(scale))

    job.execute_train(rollout_args=rollout_args, grpo_args=grpo_args, optimizer_args=optimizer_args,
                      lora_args=lora_args, perf_args=perf_args)


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
