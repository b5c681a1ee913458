"""Flow-GRPO with PickScore on Qwen-Image (LoRA), with flow_grpo's `pickscore_qwenimage` config.

What it trains:
    A LoRA on the Qwen-Image transformer with Flow-GRPO, scored by PickScore (a CLIP-style
    human-preference model). At --scale full the batch is the worked example of the launch
    docs:

        32 prompts x 16 samples       = 512 samples per rollout
        512 samples x 2 SDE steps     = 1024 train pairs
        1024 pairs / 4 DP ranks       = 256 pairs per rank
        256 / 2 steps per rollout     = 128 pairs per optimizer step per rank
        tile 8 samples x 1 timestep   = 8 pairs per forward -> 16 forwards per step

    --scale full sets the values of flow_grpo's `pickscore_qwenimage` (config/grpo.py over
    config/base.py, trained by scripts/train_qwenimage.py): noise level 1.2, an SDE window of 2
    steps starting in steps 0..3 of 10, a batch-wide reward std, lr 3e-4, LoRA rank 64 / alpha 128
    with gaussian init on the attention and MLP projections, no KL, CFG 4 with gradient through
    both branches (train_qwenimage.py does not detach the unconditional one). docs/algorithms.md's
    table lists each value beside its reference key; a unit test checks this recipe against it.

    The PPO clip range and the SDE noise level are locked to the reference's values: the launcher
    refuses an --extra-args that changes them, since the run would no longer be "aligned".
    Edit LOCKED_FLAGS below to change them on purpose.

Deliberate differences from the reference:
    - the proxy scales shrink the batch, resolution and steps to fit their devices (the
      algorithm's flags are the same); only --scale full is the reference's configuration;
    - the window start is drawn once per rollout for all samples (flow_grpo: per sampling batch),
      so every train rank holds the same steps;
    - rollout and train forwards share one dtype (bf16 at full scale, as flow_grpo's mixed
      precision) so the parity probe stays exactly 0.0.

Prerequisites:
    --scale full: `<model-dir>/Qwen-Image` (diffusers layout) and `<model-dir>/PickScore_v1`
    (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 5 GPUs):
    GPU 0-3   one train rank + one rollout engine each (colocated), 4 data-parallel ranks
    GPU 4     PickScore: 4 reward workers at 0.25 GPU each

Scales (--scale):
    full       Qwen-Image and PickScore, 512 px, 32 prompts x 16 samples, 5 GPUs
               eval: 256 held-out prompts every 30 rollouts, none before training
    gpu-proxy  our proxy-size qwen_image and a tiny CLIP, 256 px, same 5-GPU layout
    1gpu-proxy the gpu-proxy models on 1 GPU, shared by the train rank, its engine and PickScore
    cpu-proxy  our tiny qwen_image and tiny CLIP, 64 px, 2 CPU train ranks, CPU reward actor

Example:
    python3 scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py
    python3 scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py \\
        --num-rollout 50 --extra-args "--diffusion-kl-beta 0.02"
    python3 scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "qwen_image"
RELEASED_CHECKPOINT = "Qwen-Image"  # under --model-dir (--scale full), beside PickScore_v1
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80
# What makes the recipe "aligned": the launcher refuses --extra-args that change these.
LOCKED_FLAGS = {"--diffusion-clip-range": "1e-4", "--diffusion-noise-level": "1.2"}
# scripts/train_qwenimage.py's LoRA targets: the attention projections of both streams and their MLPs
LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2")


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    resolution: int
    sde_window_max_start: int  # the SDE window of 2 trained steps starts in 0..sde_window_max_start
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        U.FULL_SCALE, train_ranks=4, resolution=512, num_steps=10, sde_window_max_start=3, rollout_batch_size=32,
        n_samples_per_prompt=16, tile_samples=8, reward_gpus=1, rm_num_workers=4, num_prompts=4000,
        num_rollout=300, eval_interval=30, eval_prompts=256, save_interval=20, sharded=True,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=4, resolution=256, num_steps=10, sde_window_max_start=3, rollout_batch_size=8,
        n_samples_per_prompt=8, tile_samples=8, reward_gpus=1, rm_num_workers=4, num_prompts=64, num_rollout=4,
    ),
    "1gpu-proxy": _Scale(  # rank, engine and reward workers share one GPU: 0.5 / 0.25 / 0.25
        U.GPU_PROXY, train_ranks=1, resolution=256, num_steps=10, sde_window_max_start=3, rollout_batch_size=2,
        n_samples_per_prompt=8, tile_samples=8, reward_gpus=0.25, rm_num_workers=1, num_prompts=64, num_rollout=2,
        colocate_reward=True,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, resolution=64, num_steps=6, sde_window_max_start=2, rollout_batch_size=2,
        n_samples_per_prompt=4, tile_samples=2, reward_gpus=0, rm_num_workers=1, num_prompts=16, num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "1gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: Qwen-Image and PickScore on 5 GPUs; gpu-proxy: our proxy-size qwen_image and a "
        "tiny CLIP on the same GPUs; 1gpu-proxy: the same on one GPU; "
        "cpu-proxy: our tiny qwen_image on CPU slots.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)


def prepare(args: ScriptArgs) -> U.Assets:
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=RELEASED_CHECKPOINT, pickscore=True)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB, locked_flags=LOCKED_FLAGS)

    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout) + (
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        f"--diffusion-sde-type sde --diffusion-noise-level {LOCKED_FLAGS['--diffusion-noise-level']} "
        "--diffusion-guidance-scale 4.0 --train-uncond-branch "
    )

    grpo_args = U.flow_grpo_args(clip_range=LOCKED_FLAGS["--diffusion-clip-range"]) + (
        "--globalize-reward-std --diffusion-kl-beta 0 ")

    optimizer_args = U.optimizer_args(lr="3e-4") + "--adam-eps 1e-8 "

    lora_args = ("--use-lora --lora-rank 64 --lora-alpha 128 --lora-init-weights gaussian "
                 f"--lora-target-modules {' '.join(LORA_TARGETS)} ")

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
