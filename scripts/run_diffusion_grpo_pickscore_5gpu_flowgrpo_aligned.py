"""Flow-GRPO with PickScore on Qwen-Image (LoRA), with the batch shape of the Flow-GRPO paper.

What it trains:
    A LoRA on the Qwen-Image transformer with Flow-GRPO, scored by PickScore (a CLIP-style
    human-preference model). At --scale full the batch is the worked example of the launch
    docs:

        32 prompts x 16 samples       = 512 samples per rollout
        512 samples x 2 SDE steps     = 1024 train pairs
        1024 pairs / 4 DP ranks       = 256 pairs per rank
        256 / 2 steps per rollout     = 128 pairs per optimizer step per rank
        tile 8 samples x 1 timestep   = 8 pairs per forward -> 16 forwards per step

    The PPO clip range and the SDE noise level are locked to the paper's values: the launcher
    refuses an --extra-args that changes them, since the run would no longer be "aligned".
    Edit LOCKED_FLAGS below to change them on purpose.

Prerequisites:
    --scale full: `<model-dir>/Qwen-Image` (diffusers layout) and `<model-dir>/PickScore_v1`
    (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 5 GPUs):
    GPU 0-3   one train rank + one rollout engine each (colocated), 4 data-parallel ranks
    GPU 4     PickScore: 4 reward workers at 0.25 GPU each

Scales (--scale):
    full       Qwen-Image and PickScore, 512 px, 32 prompts x 16 samples, 5 GPUs
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
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import miles.utils.external_utils.command_utils as U

FAMILY = "qwen_image"
RELEASED_CHECKPOINT = "Qwen-Image"  # under --model-dir (--scale full)
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80
RELEASED_PICKSCORE = "PickScore_v1"  # under --model-dir (--scale full)

# What makes the recipe "aligned": the launcher refuses --extra-args that change these.
LOCKED_FLAGS = {"--diffusion-clip-range": "1e-4", "--diffusion-noise-level": "0.7"}


def gpu_memory_args(device: str) -> str:
    """--gpu-memory-gb for a GPU run (refused with --device cpu, which has no GPU budget)."""
    return f"--gpu-memory-gb {GPU_MEMORY_GB} " if device == "cuda" else ""


@dataclass(frozen=True)
class _Scale:
    """What --scale changes; the flag blocks in execute() are the same at every scale."""

    checkpoint_size: Optional[str]  # None: the released checkpoint and PickScore; else ours
    device: str
    dtype: str  # train and rollout forwards; the trained weights stay float32
    train_ranks: int  # GPUs (CPU slots on cpu), each holding a train rank and a rollout engine
    resolution: int
    num_steps: int  # denoising steps; the SDE window of 2 trained steps starts in 0..sde_window_max_start
    sde_window_max_start: int
    rollout_batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward
    reward_gpus: int  # a GPU of its own for PickScore; 0 on cpu, where the workers are CPU actors
    rm_num_workers: int  # sharing the reward GPU equally
    num_prompts: int
    num_rollout: int
    eval_interval: Optional[int]  # None: no eval
    save_interval: Optional[int]  # None: no checkpoints
    deterministic: bool
    colocate_reward: bool = False  # the reward workers take REWARD_SHARE_OF_GPU of the train GPU


# --scale 1gpu-proxy: rank, engine and reward workers share one GPU (0.5 / 0.25 / 0.25)
REWARD_SHARE_OF_GPU = 0.25

_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        checkpoint_size=None, device="cuda", dtype="bfloat16", train_ranks=4, resolution=512, num_steps=10,
        sde_window_max_start=3, rollout_batch_size=32, n_samples_per_prompt=16, tile_samples=8, reward_gpus=1,
        rm_num_workers=4, num_prompts=4000, num_rollout=300, eval_interval=10, save_interval=20,
        deterministic=False,
    ),
    "gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=4, resolution=256, num_steps=10,
        sde_window_max_start=3, rollout_batch_size=8, n_samples_per_prompt=8, tile_samples=8, reward_gpus=1,
        rm_num_workers=4, num_prompts=64, num_rollout=4, eval_interval=None, save_interval=None,
        deterministic=True,
    ),
    "1gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=1, resolution=256, num_steps=10,
        sde_window_max_start=3, rollout_batch_size=2, n_samples_per_prompt=8, tile_samples=8, reward_gpus=0,
        rm_num_workers=1, num_prompts=64, num_rollout=2, eval_interval=None, save_interval=None,
        deterministic=True, colocate_reward=True,
    ),
    "cpu-proxy": _Scale(
        checkpoint_size="tiny", device="cpu", dtype="float32", train_ranks=2, resolution=64, num_steps=6,
        sde_window_max_start=2, rollout_batch_size=2, n_samples_per_prompt=4, tile_samples=2, reward_gpus=0,
        rm_num_workers=1, num_prompts=16, num_rollout=2, eval_interval=None, save_interval=None,
        deterministic=True,
    ),
}


def reward_gpus_per_worker(scale: _Scale) -> float:
    share = REWARD_SHARE_OF_GPU if scale.colocate_reward else scale.reward_gpus
    return share / scale.rm_num_workers


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    scale: Literal["full", "gpu-proxy", "1gpu-proxy", "cpu-proxy"] = field(
        default="full",
        metadata={"help": "full: Qwen-Image and PickScore on 5 GPUs; gpu-proxy: our proxy-size qwen_image and a "
                          "tiny CLIP on the same GPUs; 1gpu-proxy: the same on one GPU; "
                          "cpu-proxy: our tiny qwen_image on CPU slots."},
    )
    num_rollout: Optional[int] = field(
        default=None,
        metadata={"help": "Rollouts to train; unset: 300 (full), 4 (gpu-proxy), 2 (1gpu-proxy, cpu-proxy)."},
    )
    model_dir: str = field(
        default=str(U.REPO_ROOT / "models"),
        metadata={"help": "Released checkpoints are read from here; ours are created here once and reused."},
    )
    data_dir: str = field(default=str(U.REPO_ROOT / "data"), metadata={"help": "Where the prompt files are written."})


class Assets(NamedTuple):
    checkpoint: str
    pickscore: str
    prompt_data: str
    eval_prompt_data: str


def prepare(args: ScriptArgs) -> Assets:
    """Make (once) the checkpoint, the PickScore model and the prompts; a dry run only names them."""
    scale = _SCALES[args.scale]
    model_dir, data_dir = Path(args.model_dir), Path(args.data_dir)
    if scale.checkpoint_size is None:  # prerequisites, not checked here
        checkpoint, pickscore = model_dir / RELEASED_CHECKPOINT, model_dir / RELEASED_PICKSCORE
    else:
        checkpoint = model_dir / f"miles-{FAMILY}-{scale.checkpoint_size}-seed0"
        pickscore = model_dir / "tiny-pickscore-seed0"
    prompt_data = data_dir / f"general_prompts_{scale.num_prompts}.jsonl"
    eval_prompt_data = data_dir / "general_eval_prompts_64.jsonl"
    if not U.is_dry_run():
        from miles.rollout.prompts import ensure_prompt_file

        ensure_prompt_file("general", prompt_data, num_prompts=scale.num_prompts, seed=0)
        ensure_prompt_file("general", eval_prompt_data, num_prompts=64, seed=1)
        if scale.checkpoint_size is not None:
            from miles.models.create_checkpoint import ensure_checkpoint
            from miles.rollout.rm_hub.pickscore import ensure_tiny_pickscore

            checkpoint = ensure_checkpoint(FAMILY, scale.checkpoint_size, 0, model_dir)
            pickscore = ensure_tiny_pickscore(model_dir, seed=0)
    return Assets(str(checkpoint), str(pickscore), str(prompt_data), str(eval_prompt_data))


def execute(args: ScriptArgs, assets: Assets) -> None:
    scale = _SCALES[args.scale]
    num_rollout = args.num_rollout if args.num_rollout is not None else scale.num_rollout
    run_dir = Path(args.output_dir).resolve() / args.run_id

    ckpt_args = f"--hf-checkpoint {assets.checkpoint} --diffusion-model-family {FAMILY} "
    if scale.save_interval:
        ckpt_args += f"--save {run_dir / 'checkpoints'} --save-interval {scale.save_interval} "

    rollout_args = (
        f"--prompt-data {assets.prompt_data} --input-key prompt --rollout-shuffle "
        f"--num-rollout {num_rollout} "
        f"--rollout-batch-size {scale.rollout_batch_size} --n-samples-per-prompt {scale.n_samples_per_prompt} "
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        f"--diffusion-sde-type sde --diffusion-noise-level {LOCKED_FLAGS['--diffusion-noise-level']} "
        "--diffusion-guidance-scale 4.0 "
    )

    eval_args = ""
    if scale.eval_interval:
        eval_args = f"--eval-interval {scale.eval_interval} --eval-prompt-data {assets.eval_prompt_data} "

    grpo_args = (
        "--loss-type policy_loss --advantage-estimator grpo "
        f"--diffusion-clip-range {LOCKED_FLAGS['--diffusion-clip-range']} --diffusion-adv-clip-max 5.0 "
        "--num-steps-per-rollout 2 "
    )

    optimizer_args = "--lr 1e-4 --adam-beta1 0.9 --adam-beta2 0.999 --weight-decay 1e-4 --clip-grad 1.0 "

    lora_args = "--use-lora --lora-rank 64 --lora-alpha 128 "

    reward_args = (
        f"--rm-type pickscore --pickscore-model-path {assets.pickscore} "
        f"--rm-num-workers {scale.rm_num_workers} "
        f"--rm-num-gpus-per-worker {reward_gpus_per_worker(scale):g} "
    )
    if scale.colocate_reward:
        reward_args += "--colocate-reward "

    engine_args = f"--rollout-num-gpus {scale.train_ranks} --rollout-num-gpus-per-engine 1 "

    train_backend_args = (
        f"--param-dtype float32 --compute-dtype {scale.dtype} --rollout-dtype {scale.dtype} "
        "--update-weight-target-module transformer "
    )

    perf_args = (
        f"--micro-batch-size-sample {scale.tile_samples} --micro-batch-size-tstep 1 "
        "--diffusion-train-iter-order sample-major --train-dp-split-mode contiguous "
    )
    if scale.device == "cuda":
        perf_args += "--gradient-checkpointing "

    misc_args = (
        f"--device {scale.device} " + gpu_memory_args(scale.device)
        + f"--actor-num-nodes 1 --actor-num-gpus-per-node {scale.train_ranks} "
        f"--num-gpus-per-node {scale.train_ranks + scale.reward_gpus} --colocate "
        "--diffusion-debug-mode "  # log train/rollout parity (exactly 0.0 when healthy)
    )
    if scale.deterministic:
        misc_args += "--deterministic-mode "

    train_args = " ".join([
        ckpt_args, rollout_args, eval_args, grpo_args, optimizer_args, lora_args, reward_args, engine_args,
        train_backend_args, perf_args, misc_args, U.get_default_wandb_args(__file__, args.run_id),
    ])
    U.execute_train(
        train_args=train_args,
        num_gpus_per_node=0 if scale.device == "cpu" else scale.train_ranks + scale.reward_gpus,
        config=args,
        locked_flags=LOCKED_FLAGS,
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
