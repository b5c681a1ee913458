"""Supervised finetuning (flow matching) of Wan2.2 text-to-video with LoRA: no rollouts, no reward.

What it trains:
    LoRA adapters on both Wan2.2 experts with the flow-matching loss (`--loss-type sft_loss`):
    each video of the dataset is noised to a few timesteps and the model regresses the velocity
    (noise - video). Each item trains 2 timesteps drawn at random from the schedule; a timestep
    belongs to `transformer` above the expert boundary and to `transformer_2` below it, and the
    2D tile of 4 items x 1 timestep keeps every forward on one expert. There are no rollout
    engines and no reward workers: every GPU is a train rank.

Prerequisites:
    --scale full: `<model-dir>/Wan2.2-T2V-A14B-Diffusers` (diffusers layout). The data is your
    own JSONL passed with --sft-data (one line per item: `{"prompt", "media", "height",
    "width", "frames"}`, `media` a PNG frame strip relative to the file, frame f at columns
    f*width..(f+1)*width); without it `prepare()` writes a synthetic set of drifting colour
    gradients at the scale's size, which is enough to watch the loss fall.

GPU layout (--scale full, 1 node, 4 GPUs):
    GPU 0-3   one train rank each, 4 data-parallel ranks; no engines, no reward

Scales (--scale):
    full       Wan2.2 A14B, 480x832 px x 33 frames, 32 items per step, 4 GPUs
    gpu-proxy  our proxy-size wan2_2, 256 px x 9 frames, same 4-GPU layout
    cpu-proxy  our tiny wan2_2, 64 px x 5 frames, 2 CPU train ranks

Example:
    python3 scripts/run_diffusion_sft_wan22.py
    python3 scripts/run_diffusion_sft_wan22.py --sft-data /data/my_videos.jsonl --num-rollout 2000
    python3 scripts/run_diffusion_sft_wan22.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_sft_wan22.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "wan2_2"
# the H200 141GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 141
RELEASED_CHECKPOINT = "Wan2.2-T2V-A14B-Diffusers"  # under --model-dir (--scale full)


@dataclass(frozen=True, kw_only=True)
class _Scale(U.Scale):
    train_ranks: int  # GPUs (CPU slots on cpu), one train rank each
    height: int
    width: int
    frames: int  # 4k + 1 for the Wan VAE
    num_steps: int  # the schedule the 2 trained timesteps per item are drawn from
    items_per_rollout: int  # dataset items per loop iteration (--rollout-batch-size)
    tile_items: int  # micro-batch tile: items x 1 timestep per forward
    num_items: int  # size of the synthetic dataset
    lr: str  # LoRA starts at zero: a proxy's few steps need a large rate and no warmup to move at all
    lr_warmup_steps: int


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        U.FULL_SCALE, train_ranks=4, height=480, width=832, frames=33, num_steps=20, items_per_rollout=32,
        tile_items=4, num_items=256, num_rollout=500, save_interval=50, lr="1e-4", lr_warmup_steps=20,
        sharded=True,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, train_ranks=4, height=256, width=256, frames=9, num_steps=10, items_per_rollout=16,
        tile_items=2, num_items=32, num_rollout=4, lr="1e-3", lr_warmup_steps=0,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, train_ranks=2, height=64, width=64, frames=5, num_steps=6, items_per_rollout=8,
        tile_items=2, num_items=16, num_rollout=2, lr="3e-3", lr_warmup_steps=0,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "gpu-proxy", "cpu-proxy", "cpu-rehearsal"] = U.scale_option(
        "full: Wan2.2 A14B on 4 GPUs; gpu-proxy: our proxy-size wan2_2 on the same GPUs; "
        "cpu-proxy: our tiny wan2_2 on CPU slots, two steps in about a minute.")
    num_rollout: Optional[int] = U.num_rollout_option(
        _SCALES, what="Loop iterations, one batch of --rollout-batch-size items each"
    )
    data_dir: str = U.data_dir_option("Where the synthetic SFT dataset is written.")
    sft_data: str = field(
        default="",
        metadata={"help": "Your own SFT JSONL (see the docstring for its format); empty: the synthetic set."},
    )


def prepare(args: ScriptArgs) -> U.Assets:
    """Make (once) the checkpoint and the synthetic dataset; a dry run only names them."""
    scale = _SCALES[args.scale]
    # first: a released checkpoint that cannot be had (offline) stops the run before the dataset is built
    checkpoint = U.ensure_recipe_checkpoint(FAMILY, scale.checkpoint_size, args.model_dir, RELEASED_CHECKPOINT)
    size = f"{scale.height}x{scale.width}x{scale.frames}"
    sft_data = args.sft_data or str(Path(args.data_dir) / f"sft_{FAMILY}_{size}_{scale.num_items}.jsonl")
    if not args.sft_data and not U.is_dry_run():
        from miles.proxy_assets.prompts import ensure_sft_dataset

        sft_data = str(ensure_sft_dataset(
            sft_data, FAMILY, scale.num_items, scale.height, scale.width, scale.frames, seed=0
        ))
    return U.Assets(checkpoint, prompt_data=sft_data)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    # the only recipe of its kind, so no block is shared: the job joins this recipe's blocks and launches them
    job = U.TrainJob(__file__, args, num_gpus_per_node=scale.ray_gpus(scale.train_ranks))

    ckpt_args = U.ckpt_args(FAMILY, assets.checkpoint, args, scale.save_interval)

    rollout_args = (  # no rollouts here: the batch is dataset items, one "sample" each
        U.prompt_batch_args(assets.prompt_data, scale.num_rollout_or_default(args.num_rollout),
                            scale.items_per_rollout, samples_per_prompt=1)
        + f"--diffusion-height {scale.height} --diffusion-width {scale.width} "
        f"--diffusion-output-num-frames {scale.frames} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        "--diffusion-step-strategy-path epoch_global_random_choice "
        "--diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "  # high-noise, low-noise expert
    )

    grpo_args = "--loss-type sft_loss --num-steps-per-rollout 2 "

    optimizer_args = U.optimizer_args(
        lr=scale.lr, schedule=f"--lr-warmup-steps {scale.lr_warmup_steps} --lr-decay-style cosine --min-lr 1e-5 "
    )

    lora_args = "--use-lora --lora-rank 32 --lora-alpha 32 "

    # a fixed dataset: no rollout engines, hence no reward and no eval (eval generates videos)
    engine_args = "--train-only "

    train_backend_args = U.train_backend_args(scale.dtype, update_weights="transformer transformer_2", rollout=False,
                                                sharded=scale.sharded)

    # one timestep per forward: every forward is on one expert
    perf_args = U.tile_args(scale.tile_items) + U.gradient_checkpointing_args(scale)

    misc_args = (
        U.gpu_layout_args(scale.device, GPU_MEMORY_GB, train_gpus=scale.train_ranks, gpus_per_node=scale.train_ranks)
        + U.deterministic_args(scale.deterministic)
    )

    job.execute_train(
        ckpt_args=ckpt_args, rollout_args=rollout_args, grpo_args=grpo_args, optimizer_args=optimizer_args,
        lora_args=lora_args, engine_args=engine_args, train_backend_args=train_backend_args, perf_args=perf_args,
        misc_args=misc_args,
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
