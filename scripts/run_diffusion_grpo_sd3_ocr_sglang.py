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
    gpu-proxy  our proxy-size sd3 (fills a GPU), 256 px, small batch, same 2-GPU layout
    cpu-proxy  our tiny sd3, 64 px, 2 CPU train ranks; two rollouts in about a minute

Example:
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --model-name sd3.5-large --num-rollout 200
    python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --scale cpu-proxy
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_sd3_ocr_sglang.py --output-dir /tmp/dry
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import miles.utils.external_utils.command_utils as U

FAMILY = "sd3"
# the H100 80GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 80


def gpu_memory_args(device: str) -> str:
    """--gpu-memory-gb for a GPU run (refused with --device cpu, which has no GPU budget)."""
    return f"--gpu-memory-gb {GPU_MEMORY_GB} " if device == "cuda" else ""


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


@dataclass(frozen=True)
class _Scale:
    """What --scale changes; the flag blocks in execute() are the same at every scale."""

    checkpoint_size: Optional[str]  # None: the released checkpoint; "proxy" / "tiny": one we create
    device: str
    dtype: str  # train and rollout forwards; the trained weights stay float32
    train_ranks: int  # GPUs (CPU slots on cpu), each holding a train rank and a rollout engine
    resolution: int
    num_steps: int  # denoising steps; the SDE window of 2 trained steps starts in 0..sde_window_max_start
    sde_window_max_start: int
    rollout_batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
    tile_samples: int  # micro-batch tile: samples x 1 timestep per forward
    rm_num_workers: int
    num_prompts: int
    num_rollout: int
    eval_interval: Optional[int]  # None: no eval
    save_interval: Optional[int]  # None: no checkpoints
    deterministic: bool


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        checkpoint_size=None, device="cuda", dtype="bfloat16", train_ranks=2, resolution=512, num_steps=10,
        sde_window_max_start=3, rollout_batch_size=16, n_samples_per_prompt=16, tile_samples=8, rm_num_workers=4,
        num_prompts=2000, num_rollout=400, eval_interval=10, save_interval=20, deterministic=False,
    ),
    "gpu-proxy": _Scale(
        checkpoint_size="proxy", device="cuda", dtype="bfloat16", train_ranks=2, resolution=256, num_steps=10,
        sde_window_max_start=3, rollout_batch_size=4, n_samples_per_prompt=8, tile_samples=4, rm_num_workers=2,
        num_prompts=64, num_rollout=4, eval_interval=None, save_interval=None, deterministic=True,
    ),
    "cpu-proxy": _Scale(
        checkpoint_size="tiny", device="cpu", dtype="float32", train_ranks=2, resolution=64, num_steps=6,
        sde_window_max_start=2, rollout_batch_size=2, n_samples_per_prompt=4, tile_samples=2, rm_num_workers=1,
        num_prompts=16, num_rollout=2, eval_interval=None, save_interval=None, deterministic=True,
    ),
}


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    model_name: Literal["sd3.5-medium", "sd3.5-large"] = field(
        default="sd3.5-medium",
        metadata={"help": "SD3.5 variant: its released checkpoint (--scale full), guidance, LoRA rank and LR."},
    )
    scale: Literal["full", "gpu-proxy", "cpu-proxy"] = field(
        default="full",
        metadata={"help": "full: the released checkpoint on 2 GPUs; gpu-proxy: our proxy-size sd3 on the same "
                          "GPUs; cpu-proxy: our tiny sd3 on CPU slots, two rollouts in about a minute."},
    )
    num_rollout: Optional[int] = field(
        default=None, metadata={"help": "Rollouts to train; unset: 400 (full), 4 (gpu-proxy), 2 (cpu-proxy)."}
    )
    model_dir: str = field(
        default=str(U.REPO_ROOT / "models"),
        metadata={"help": "Released checkpoints are read from here; ours are created here once and reused."},
    )
    data_dir: str = field(default=str(U.REPO_ROOT / "data"), metadata={"help": "Where the prompt files are written."})
    kl_beta: float = field(default=0.04, metadata={"help": "Weight of the KL to the LoRA base (--diffusion-kl-beta)."})


class Assets(NamedTuple):
    checkpoint: str
    prompt_data: str
    eval_prompt_data: str


def prepare(args: ScriptArgs) -> Assets:
    """Make (once) the checkpoint and the OCR prompt files; a dry run only names their paths."""
    recipe, scale = U.select_recipe(_RECIPES, args.model_name), _SCALES[args.scale]
    model_dir, data_dir = Path(args.model_dir), Path(args.data_dir)
    if scale.checkpoint_size is None:
        checkpoint = model_dir / recipe.checkpoint  # a prerequisite, not checked here
    else:
        checkpoint = model_dir / f"miles-{FAMILY}-{scale.checkpoint_size}-seed0"
    prompt_data = data_dir / f"ocr_prompts_{scale.num_prompts}.jsonl"
    eval_prompt_data = data_dir / "ocr_eval_prompts_64.jsonl"
    if not U.is_dry_run():
        from miles.rollout.prompts import ensure_prompt_file

        ensure_prompt_file("ocr", prompt_data, num_prompts=scale.num_prompts, seed=0)
        ensure_prompt_file("ocr", eval_prompt_data, num_prompts=64, seed=1)
        if scale.checkpoint_size is not None:
            from miles.models.create_checkpoint import ensure_checkpoint

            checkpoint = ensure_checkpoint(FAMILY, scale.checkpoint_size, 0, model_dir)
    return Assets(str(checkpoint), str(prompt_data), str(eval_prompt_data))


def execute(args: ScriptArgs, assets: Assets) -> None:
    recipe, scale = U.select_recipe(_RECIPES, args.model_name), _SCALES[args.scale]
    num_rollout = args.num_rollout if args.num_rollout is not None else scale.num_rollout
    run_dir = Path(args.output_dir).resolve() / args.run_id

    ckpt_args = f"--hf-checkpoint {assets.checkpoint} --diffusion-model-family {FAMILY} "
    if scale.save_interval:
        ckpt_args += f"--save {run_dir / 'checkpoints'} --save-interval {scale.save_interval} "

    rollout_args = (
        f"--prompt-data {assets.prompt_data} --input-key prompt --metadata-key metadata --rollout-shuffle "
        f"--num-rollout {num_rollout} "
        f"--rollout-batch-size {scale.rollout_batch_size} --n-samples-per-prompt {scale.n_samples_per_prompt} "
        f"--diffusion-height {scale.resolution} --diffusion-width {scale.resolution} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        f"--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start {scale.sde_window_max_start} "
        f"--diffusion-sde-type sde --diffusion-noise-level 0.7 --diffusion-guidance-scale {recipe.guidance_scale} "
    )

    eval_args = ""
    if scale.eval_interval:
        eval_args = f"--eval-interval {scale.eval_interval} --eval-prompt-data {assets.eval_prompt_data} "

    grpo_args = (
        "--loss-type policy_loss --advantage-estimator grpo "
        "--diffusion-clip-range 1e-4 --diffusion-adv-clip-max 5.0 "
        f"--diffusion-kl-beta {args.kl_beta} --diffusion-kl-reference lora_base "
        "--num-steps-per-rollout 2 "
    )

    optimizer_args = f"--lr {recipe.lr} --adam-beta1 0.9 --adam-beta2 0.999 --weight-decay 1e-4 --clip-grad 1.0 "

    lora_args = f"--use-lora --lora-rank {recipe.lora_rank} --lora-alpha {recipe.lora_rank} "

    reward_args = f"--rm-type ocr --rm-num-workers {scale.rm_num_workers} --rm-num-gpus-per-worker 0 "

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
        f"--num-gpus-per-node {scale.train_ranks} --colocate "
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
        num_gpus_per_node=0 if scale.device == "cpu" else scale.train_ranks,
        config=args,
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
