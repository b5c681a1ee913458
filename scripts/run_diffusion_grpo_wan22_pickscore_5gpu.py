"""Flow-GRPO with PickScore on Wan2.2 text-to-video (LoRA on the high-noise expert).

What it trains:
    A LoRA on `transformer`, the high-noise expert of Wan2.2 A14B, with Flow-GRPO; each video
    is scored by PickScore (the mean over a few of its frames). Wan2.2 denoises with two
    experts: `transformer` above the boundary (t >= 0.875 x 1000), `transformer_2` below it,
    each with its own guidance scale (--diffusion-guidance-scale / -2). Exploration happens in
    the high-noise phase, where the layout of the video is decided: the 2-step SDE window always
    ends before the boundary, so only `transformer` is trained and synced, and a flat
    `--micro-batch-size 2` (the two trained steps of one sample) never mixes the experts in
    one forward. The low-noise expert still runs in every rollout, with its own guidance scale.

Prerequisites:
    --scale full: `<model-dir>/Wan2.2-T2V-A14B-Diffusers` (diffusers layout, both experts) and
    `<model-dir>/PickScore_v1` (a CLIPModel folder with its tokenizer and image processor).

GPU layout (--scale full, 1 node, 5 GPUs):
    GPU 0-3   one train rank + one rollout engine each (colocated), 4 data-parallel ranks
    GPU 4     PickScore: 4 reward workers at 0.25 GPU each

Scales (--scale):
    full       Wan2.2 A14B and PickScore, 480x832 px x 33 frames, 8 prompts x 8 samples, 5 GPUs
    gpu-proxy  our proxy-size wan2_2 and a tiny CLIP, 256 px x 9 frames, same 5-GPU layout
    1gpu-proxy the gpu-proxy models on 1 GPU, shared by the train rank, its engine and PickScore
    cpu-proxy  our tiny wan2_2 and tiny CLIP, 64 px x 5 frames, 2 CPU train ranks, CPU reward actor

Example:
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --num-rollout 50 --extra-args "--diffusion-kl-beta 0.02"
    python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py --output-dir /tmp/dry
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
RELEASED_PICKSCORE = "PickScore_v1"  # under --model-dir (--scale full)


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
    height: int
    width: int
    frames: int  # 4k + 1 for the Wan VAE
    num_steps: int  # denoising steps; with shift 12 the expert boundary is at step 13 of 20, 7 of 10, 4 of 6
    sde_window_max_start: int  # the 2-step window must end before the boundary: at most boundary - 2
    rollout_batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
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
        checkpoint_size=None, device="cuda", dtype="bfloat16", train_ranks=4, height=480, width=832, frames=33,
        num_steps=20, sde_window_max_start=6, rollout_batch_size=8, n_samples_per_prompt=8, reward_gpus=1,
        rm_num_workers=4, num_prompts=4000, num_rollout=200, eval_interval=10, save_interval=20,
        deterministic=False,
    ),
    "gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=4, height=256, width=256, frames=9,
        num_steps=10, sde_window_max_start=4, rollout_batch_size=4, n_samples_per_prompt=4, reward_gpus=1,
        rm_num_workers=4, num_prompts=64, num_rollout=4, eval_interval=None, save_interval=None,
        deterministic=True,
    ),
    "1gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=1, height=256, width=256, frames=9,
        num_steps=10, sde_window_max_start=4, rollout_batch_size=2, n_samples_per_prompt=4, reward_gpus=0,
        rm_num_workers=1, num_prompts=64, num_rollout=2, eval_interval=None, save_interval=None,
        deterministic=True, colocate_reward=True,
    ),
    "cpu-proxy": _Scale(
        checkpoint_size="tiny", device="cpu", dtype="float32", train_ranks=2, height=64, width=64, frames=5,
        num_steps=6, sde_window_max_start=2, rollout_batch_size=2, n_samples_per_prompt=4, reward_gpus=0,
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
        metadata={"help": "full: Wan2.2 A14B and PickScore on 5 GPUs; gpu-proxy: our proxy-size wan2_2 and a tiny "
                          "CLIP on the same GPUs; cpu-proxy: our tiny wan2_2 on CPU slots."},
    )
    num_rollout: Optional[int] = field(
        default=None,
        metadata={"help": "Rollouts to train; unset: 200 (full), 4 (gpu-proxy), 2 (1gpu-proxy, cpu-proxy)."},
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
        f"--diffusion-height {scale.height} --diffusion-width {scale.width} "
        f"--diffusion-output-num-frames {scale.frames} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        "--diffusion-sde-type sde --diffusion-noise-level 0.7 "
        "--diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "  # high-noise, low-noise expert
    )

    eval_args = ""
    if scale.eval_interval:
        eval_args = f"--eval-interval {scale.eval_interval} --eval-prompt-data {assets.eval_prompt_data} "

    grpo_args = (
        "--loss-type policy_loss --advantage-estimator grpo "
        "--diffusion-clip-range 1e-4 --diffusion-adv-clip-max 5.0 "
        "--num-steps-per-rollout 2 "
    )

    optimizer_args = "--lr 1e-4 --adam-beta1 0.9 --adam-beta2 0.999 --weight-decay 1e-4 --clip-grad 1.0 "

    lora_args = "--use-lora --lora-rank 32 --lora-alpha 64 "

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
        "--update-weight-target-module transformer "  # the high-noise expert only
    )

    perf_args = (  # 2 consecutive pairs = one sample's two trained steps, always on one expert
        "--micro-batch-size 2 --train-dp-split-mode contiguous "
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
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
