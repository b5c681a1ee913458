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
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import miles.utils.external_utils.command_utils as U

FAMILY = "wan2_2"
# the H200 141GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 141
RELEASED_CHECKPOINT = "Wan2.2-T2V-A14B-Diffusers"  # under --model-dir (--scale full)


def gpu_memory_args(device: str) -> str:
    """--gpu-memory-gb for a GPU run (refused with --device cpu, which has no GPU budget)."""
    return f"--gpu-memory-gb {GPU_MEMORY_GB} " if device == "cuda" else ""


@dataclass(frozen=True)
class _Scale:
    """What --scale changes; the flag blocks in execute() are the same at every scale."""

    checkpoint_size: Optional[str]  # None: the released checkpoint; else one we create
    device: str
    dtype: str  # train forwards; the trained weights stay float32
    train_ranks: int  # GPUs (CPU slots on cpu), one train rank each
    height: int
    width: int
    frames: int  # 4k + 1 for the Wan VAE
    num_steps: int  # the schedule the 2 trained timesteps per item are drawn from
    items_per_rollout: int  # dataset items per loop iteration (--rollout-batch-size)
    tile_items: int  # micro-batch tile: items x 1 timestep per forward
    num_items: int  # size of the synthetic dataset
    num_rollout: int
    save_interval: Optional[int]  # None: no checkpoints
    deterministic: bool
    lr: str  # LoRA starts at zero: a proxy's few steps need a large rate and no warmup to move at all
    lr_warmup_steps: int


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        checkpoint_size=None, device="cuda", dtype="bfloat16", train_ranks=4, height=480, width=832, frames=33,
        num_steps=20, items_per_rollout=32, tile_items=4, num_items=256, num_rollout=500, save_interval=50,
        deterministic=False, lr="1e-4", lr_warmup_steps=20,
    ),
    "gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=4, height=256, width=256, frames=9,
        num_steps=10, items_per_rollout=16, tile_items=2, num_items=32, num_rollout=4, save_interval=None,
        deterministic=True, lr="1e-3", lr_warmup_steps=0,
    ),
    "cpu-proxy": _Scale(
        checkpoint_size="tiny", device="cpu", dtype="float32", train_ranks=2, height=64, width=64, frames=5,
        num_steps=6, items_per_rollout=8, tile_items=2, num_items=16, num_rollout=2, save_interval=None,
        deterministic=True, lr="3e-3", lr_warmup_steps=0,
    ),
}


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    scale: Literal["full", "gpu-proxy", "cpu-proxy"] = field(
        default="full",
        metadata={"help": "full: Wan2.2 A14B on 4 GPUs; gpu-proxy: our proxy-size wan2_2 on the same GPUs; "
                          "cpu-proxy: our tiny wan2_2 on CPU slots, two steps in about a minute."},
    )
    num_rollout: Optional[int] = field(
        default=None,
        metadata={"help": "Loop iterations, one batch of --rollout-batch-size items each; unset: 500 (full), "
                          "4 (gpu-proxy), 2 (cpu-proxy)."},
    )
    model_dir: str = field(
        default=str(U.REPO_ROOT / "models"),
        metadata={"help": "Released checkpoints are read from here; ours are created here once and reused."},
    )
    data_dir: str = field(
        default=str(U.REPO_ROOT / "data"), metadata={"help": "Where the synthetic SFT dataset is written."}
    )
    sft_data: str = field(
        default="",
        metadata={"help": "Your own SFT JSONL (see the docstring for its format); empty: the synthetic set."},
    )


class Assets(NamedTuple):
    checkpoint: str
    sft_data: str


def prepare(args: ScriptArgs) -> Assets:
    """Make (once) the checkpoint and the synthetic dataset; a dry run only names them."""
    scale = _SCALES[args.scale]
    model_dir = Path(args.model_dir)
    if scale.checkpoint_size is None:
        checkpoint = model_dir / RELEASED_CHECKPOINT  # a prerequisite, not checked here
    else:
        checkpoint = model_dir / f"miles-{FAMILY}-{scale.checkpoint_size}-seed0"
    size = f"{scale.height}x{scale.width}x{scale.frames}"
    synthetic = Path(args.data_dir) / f"sft_{FAMILY}_{size}_{scale.num_items}.jsonl"
    sft_data = Path(args.sft_data) if args.sft_data else synthetic
    if not U.is_dry_run():
        if not args.sft_data:
            from miles.rollout.prompts import ensure_sft_dataset

            sft_data = ensure_sft_dataset(
                sft_data, FAMILY, scale.num_items, scale.height, scale.width, scale.frames, seed=0
            )
        if scale.checkpoint_size is not None:
            from miles.models.create_checkpoint import ensure_checkpoint

            checkpoint = ensure_checkpoint(FAMILY, scale.checkpoint_size, 0, model_dir)
    return Assets(str(checkpoint), str(sft_data))


def execute(args: ScriptArgs, assets: Assets) -> None:
    scale = _SCALES[args.scale]
    num_rollout = args.num_rollout if args.num_rollout is not None else scale.num_rollout
    run_dir = Path(args.output_dir).resolve() / args.run_id

    ckpt_args = f"--hf-checkpoint {assets.checkpoint} --diffusion-model-family {FAMILY} "
    if scale.save_interval:
        ckpt_args += f"--save {run_dir / 'checkpoints'} --save-interval {scale.save_interval} "

    rollout_args = (  # no rollouts here: the batch is dataset items, one "sample" each
        f"--prompt-data {assets.sft_data} --input-key prompt --rollout-shuffle "
        f"--num-rollout {num_rollout} "
        f"--rollout-batch-size {scale.items_per_rollout} --n-samples-per-prompt 1 "
        f"--diffusion-height {scale.height} --diffusion-width {scale.width} "
        f"--diffusion-output-num-frames {scale.frames} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        "--diffusion-step-strategy-path epoch_global_random_choice "
        "--diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "  # high-noise, low-noise expert
    )

    eval_args = ""  # eval generates videos, which needs engines; this recipe runs none

    grpo_args = "--loss-type sft_loss --num-steps-per-rollout 2 "

    optimizer_args = (
        f"--lr {scale.lr} --lr-warmup-steps {scale.lr_warmup_steps} --lr-decay-style cosine --min-lr 1e-5 "
        "--adam-beta1 0.9 --adam-beta2 0.999 --weight-decay 1e-4 --clip-grad 1.0 "
    )

    lora_args = "--use-lora --lora-rank 32 --lora-alpha 32 "

    reward_args = ""  # SFT has no reward

    engine_args = "--train-only "  # SFT trains on a fixed dataset: no rollout engines

    train_backend_args = (
        f"--param-dtype float32 --compute-dtype {scale.dtype} "
        "--update-weight-target-module transformer transformer_2 "
    )

    perf_args = (  # one timestep per forward: every forward is on one expert
        f"--micro-batch-size-sample {scale.tile_items} --micro-batch-size-tstep 1 "
        "--diffusion-train-iter-order sample-major --train-dp-split-mode contiguous "
    )
    if scale.device == "cuda":
        perf_args += "--gradient-checkpointing "

    misc_args = (
        f"--device {scale.device} " + gpu_memory_args(scale.device)
        + f"--actor-num-nodes 1 --actor-num-gpus-per-node {scale.train_ranks} "
        f"--num-gpus-per-node {scale.train_ranks} "
    )
    if scale.deterministic:
        misc_args += "--deterministic-mode "

    train_args = " ".join([
        ckpt_args, rollout_args, eval_args, grpo_args, optimizer_args, lora_args, reward_args, engine_args,
        train_backend_args, perf_args, misc_args, U.get_default_wandb_args(__file__, args.run_id),
    ])
    U.execute_train(
        train_args=train_args,
        num_gpus_per_node=0 if scale.device == "cpu" else scale.train_ranks,
        config=args,
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
