"""Flow-GRPO with PickScore on a Cosmos text-to-image model (full finetune, everything colocated).

What it trains:
    The whole Cosmos transformer (text-to-image: images are one-frame videos to it) with
    Flow-GRPO, each image scored by PickScore (a CLIP-style human-preference model). Train
    ranks, rollout engines and the PickScore workers all share the same 4 GPUs, so no GPU is
    set aside for the reward.

Prerequisites:
    --scale full: `<model-dir>/Cosmos-Predict2-2B-Text2Image` (diffusers layout) and
    `<model-dir>/PickScore_v1` (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 4 GPUs):
    GPU 0-3   one train rank + one rollout engine + one PickScore worker each (colocated),
              4 data-parallel ranks

Scales (--scale):
    full       Cosmos and PickScore, 768 px, 16 prompts x 8 samples, 4 GPUs
               eval: 256 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size cosmos3 and a tiny CLIP, 256 px, same 4-GPU layout
    cpu-proxy  our tiny cosmos3 and tiny CLIP, 64 px, 2 CPU train ranks

Example:
    python3 scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py
    python3 scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py --num-rollout 100 --extra-args "--lr 5e-6"
    python3 scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass
from typing import Literal, Optional

import miles.launcher.recipe_api as U

RELEASED_CHECKPOINT = "Cosmos-Predict2-2B-Text2Image"  # under --model-dir (--scale full), beside PickScore_v1
FAMILY = "cosmos3"
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    resolution: int
    sde_window_max_start: int  # the SDE window of 2 trained steps starts in 0..sde_window_max_start
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward


_SCALES: dict[str, _Scale] = {  # PickScore workers beside the engines, on a slice of their GPUs
    "full": _Scale(
        U.FULL_SCALE, train_ranks=4, resolution=768, num_steps=10, sde_window_max_start=3, rollout_batch_size=16,
        n_samples_per_prompt=8, tile_samples=8, rm_num_workers=4, reward_gpus=0.4, colocate_reward=True,
        num_prompts=4000, num_rollout=300, eval_interval=30, eval_prompts=256, save_interval=20,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=4, resolution=256, num_steps=10, sde_window_max_start=3, rollout_batch_size=8,
        n_samples_per_prompt=4, tile_samples=4, rm_num_workers=4, reward_gpus=0.4, colocate_reward=True, num_prompts=64,
        num_rollout=4,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, resolution=64, num_steps=6, sde_window_max_start=2, rollout_batch_size=2,
        n_samples_per_prompt=4, tile_samples=2, rm_num_workers=1, colocate_reward=True, num_prompts=16,
        num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: Cosmos and PickScore on 4 GPUs; gpu-proxy: our proxy-size cosmos3 and a tiny CLIP "
        "on the same GPUs; cpu-proxy: our tiny cosmos3 on CPU slots.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)


def prepare(args: ScriptArgs) -> U.Assets:
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=RELEASED_CHECKPOINT, pickscore=True)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB)

    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout) + (
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        "--diffusion-sde-type sde --diffusion-noise-level 0.7 --diffusion-guidance-scale 4.0 "
    )

    grpo_args = U.flow_grpo_args()

    optimizer_args = U.optimizer_args(lr="1e-5")

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
