"""Flow-GRPO with PickScore on Wan2.2 text-to-video (LoRA on the high-noise expert).

What it trains:
    A LoRA on `transformer`, the high-noise expert of Wan2.2 A14B, with Flow-GRPO; each video
    is scored by PickScore (the mean over a few of its frames). Wan2.2 denoises with two
    experts: `transformer` above the boundary (t >= 0.875 x 1000), `transformer_2` below it,
    each with its own guidance scale (--diffusion-guidance-scale / -2). Exploration happens in
    the high-noise phase, where the layout of the video is decided: the 2-step SDE window always
    ends before the boundary, so only `transformer` is trained and synced, and a forward of
    2 samples at one timestep (the engines' microgroup of 2) never mixes the experts. The low-noise expert still runs in every rollout, with its own guidance scale.

Prerequisites:
    --scale full: `<model-dir>/Wan2.2-T2V-A14B-Diffusers` (diffusers layout, both experts) and
    `<model-dir>/PickScore_v1` (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 5 GPUs):
    GPU 0-3   one train rank + one rollout engine each (colocated), 4 data-parallel ranks
    GPU 4     PickScore: 4 reward workers at 0.25 GPU each

Scales (--scale):
    full       Wan2.2 A14B and PickScore, 480x832 px x 33 frames, 8 prompts x 8 samples, 5 GPUs
               eval: 64 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size wan2_2 and a tiny CLIP, 256 px x 9 frames, same 5-GPU layout
    1gpu-proxy the gpu-proxy models on 1 GPU, shared by the train rank, its engine and PickScore
    cpu-proxy  our tiny wan2_2 and tiny CLIP, 64 px x 5 frames, 2 CPU train ranks, CPU reward actor

Example:
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --num-rollout 50 --extra-args "--diffusion-kl-beta 0.02"
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "wan2_2"
# the H200 141GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 141
RELEASED_CHECKPOINT = "Wan2.2-T2V-A14B-Diffusers"  # under --model-dir (--scale full), beside PickScore_v1


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    height: int
    width: int
    frames: int  # 4k + 1 for the Wan VAE
    # with shift 12 the expert boundary is at step 13 of 20, 7 of 10, 4 of 6 (num_steps); the 2-step
    # window must end before it: sde_window_max_start is at most boundary - 2
    sde_window_max_start: int


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        U.FULL_SCALE, train_ranks=4, height=480, width=832, frames=33, num_steps=20, sde_window_max_start=6,
        rollout_batch_size=8, n_samples_per_prompt=8, reward_gpus=1, rm_num_workers=4, num_prompts=4000,
        num_rollout=200, eval_interval=30, eval_prompts=64, save_interval=20, sharded=True,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=4, height=256, width=256, frames=9, num_steps=10, sde_window_max_start=4,
        rollout_batch_size=4, n_samples_per_prompt=4, reward_gpus=1, rm_num_workers=4, num_prompts=64,
        num_rollout=4,
    ),
    "1gpu-proxy": _Scale(  # rank, engine and reward workers share one GPU: 0.5 / 0.25 / 0.25
        U.GPU_PROXY, train_ranks=1, height=256, width=256, frames=9, num_steps=10, sde_window_max_start=4,
        rollout_batch_size=2, n_samples_per_prompt=4, reward_gpus=0.25, rm_num_workers=1, num_prompts=64,
        num_rollout=2, colocate_reward=True,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, height=64, width=64, frames=5, num_steps=6, sde_window_max_start=2,
        rollout_batch_size=2, n_samples_per_prompt=4, reward_gpus=0, rm_num_workers=1, num_prompts=16,
        num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "1gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: Wan2.2 A14B and PickScore on 5 GPUs; gpu-proxy: our proxy-size wan2_2 and a tiny CLIP on the same "
        "GPUs; cpu-proxy: our tiny wan2_2 on CPU slots.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)


def prepare(args: ScriptArgs) -> U.Assets:
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=RELEASED_CHECKPOINT, pickscore=True)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB)

    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout) + (
        f"--diffusion-height {scale.height} --diffusion-width {scale.width} "
        f"--diffusion-output-num-frames {scale.frames} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        "--diffusion-sde-type sde --diffusion-noise-level 0.7 "
        "--diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "  # high-noise, low-noise expert
    )

    grpo_args = U.flow_grpo_args()

    optimizer_args = U.optimizer_args(lr="1e-4")

    # on `transformer`, the high-noise expert: the only module the job trains and syncs
    lora_args = "--use-lora --lora-rank 32 --lora-alpha 64 "

    # 2 samples x 1 timestep per forward, always on one expert; the engines sample in microgroups of
    # those 2 samples, so each train forward is one the engines ran
    perf_args = U.tile_args(2) + "--rollout-microgroup-size 2 " + U.gradient_checkpointing_args(scale)

    job.execute_train(rollout_args=rollout_args, grpo_args=grpo_args, optimizer_args=optimizer_args,
                      lora_args=lora_args, perf_args=perf_args)


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
