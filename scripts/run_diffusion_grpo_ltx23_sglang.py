"""Flow-GRPO with PickScore on LTX-2.3 video (full finetune, CPS SDE, unguided).

What it trains:
    The LTX-2.3 audio-video transformer with Flow-GRPO, each video scored by PickScore (the mean
    over a few of its frames). LTX samples without classifier-free guidance (one forward per step),
    and its exploration noise comes from the CPS SDE (`--diffusion-sde-type cps`), whose noise
    at each step is sigma_next * sin(a * pi / 2) and whose log-prob drops the constants.

Prerequisites:
    --scale full: `<model-dir>/LTX-2.3` (diffusers layout; else fetched from the Hub's
    diffusers/LTX-2.3-Diffusers) and `<model-dir>/PickScore_v1` (a CLIPModel folder with its
    tokenizer and image processor). LTX-2.3 is an LTX-2 audio-video model
    (`LTX2VideoTransformer3DModel`, Gemma-3 text encoder, text connectors, video and audio VAEs),
    which the `ltx2` family runs at every scale: the sampler's state joins the video and the audio
    latents (miles/models/families/ltx2.py) and the reward scores the video frames.

GPU layout (--scale full, 1 node, 5 H200 141 GB GPUs):
    GPU 0-3   one train rank + one rollout engine each (sharing the GPU, taking turns on it:
              offloaded between phases), 4 FSDP ranks sharding the 19 B transformer
    GPU 4     PickScore: 4 reward workers at 0.25 GPU each

Scales (--scale):
    full       LTX-2.3 and PickScore, 512x768 px x 25 frames, 8 prompts x 8 samples, 5 GPUs
               eval: 64 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size ltx2 and a tiny CLIP, 256 px x 9 frames, same 5-GPU layout
    cpu-proxy  our tiny ltx2 and tiny CLIP, 64 px x 9 frames, 2 CPU train ranks, CPU reward actor

Example:
    python3 scripts/run_diffusion_grpo_ltx23_sglang.py
    python3 scripts/run_diffusion_grpo_ltx23_sglang.py --num-rollout 100 --extra-args "--diffusion-noise-level 0.5"
    python3 scripts/run_diffusion_grpo_ltx23_sglang.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_ltx23_sglang.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "ltx2"
RELEASED_CHECKPOINT = "LTX-2.3"  # under --model-dir (--scale full), beside PickScore_v1
# the H200 141GB GPUs this recipe is laid out for (LTX-2.3 pipeline: 35 B params, 66 GiB in bfloat16 per
# engine); the memory plan checks its estimate against them
GPU_MEMORY_GB = 141


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    height: int
    width: int
    frames: int  # 8k + 1 for the LTX VAE
    sde_window_max_start: int  # the SDE window of 2 trained steps starts in 0..sde_window_max_start
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        U.FULL_SCALE, train_ranks=4, sharded=True, height=512, width=768, frames=25, num_steps=20, sde_window_max_start=6,
        rollout_batch_size=8, n_samples_per_prompt=8, tile_samples=4, reward_gpus=1, rm_num_workers=4,
        num_prompts=4000, num_rollout=200, eval_interval=30, eval_prompts=64, save_interval=20,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=4, height=256, width=256, frames=9, num_steps=10, sde_window_max_start=3,
        rollout_batch_size=4, n_samples_per_prompt=4, tile_samples=2, reward_gpus=1, rm_num_workers=4,
        num_prompts=64, num_rollout=4,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, height=64, width=64, frames=9, num_steps=6, sde_window_max_start=2,
        rollout_batch_size=2, n_samples_per_prompt=4, tile_samples=2, reward_gpus=0, rm_num_workers=1,
        num_prompts=16, num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: LTX-2.3 and PickScore on 5 GPUs; gpu-proxy: our proxy-size ltx2 and a tiny CLIP on the "
        "same GPUs; cpu-proxy: our tiny ltx2 on CPU slots.")
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
        "--diffusion-sde-type cps --diffusion-noise-level 0.7 "
        "--diffusion-guidance-scale 1.0 "  # unguided: one forward per step, no negative prompt
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
