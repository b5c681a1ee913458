"""Flow-GRPO on a tiny SD3-family model, on this machine's CPU: the embedded default recipe.

What it trains:
    A tiny `sd3` model that our own code builds from a seed (a small MMDiT transformer, a small
    CLIP text encoder with our tokenizer, a small VAE fitted to simple images; a few MB) learns
    with Flow-GRPO to paint brighter images. The reward is the built-in `brightness` (mean
    luminance): it needs no model, and the tiny decoder can express it, so the reward climbs
    within a few rollouts and a whole rollout (sample, score, train, sync) takes seconds on a
    laptop CPU. Swap in `--extra-args "--rm-type color_match"` for a prompt-dependent reward; at
    this size it learns far more slowly.

Prerequisites:
    None. `prepare()` creates the checkpoint under --model-dir and the prompt file under
    --data-dir on first use (deterministic, nothing downloaded) and reuses them afterwards.

CPU layout (the default, --device cpu; no GPU is used, even where one is present):
    a Ray head with CPU slots; one train rank with a rollout engine colocated on its slot
    (--train-ranks 2 for two data-parallel ranks), and one reward worker on a slice of a CPU.
GPU layout (--device cuda, the nightly GPU smoke test): the same ranks and engines, one GPU
    each, training and sampling in bfloat16 over float32 master weights; the reward stays on CPU.

Example:
    python3 scripts/run_diffusion_grpo_tiny_cpu.py
    python3 scripts/run_diffusion_grpo_tiny_cpu.py --num-rollout 60 --extra-args "--lr 5e-4"
    python3 scripts/run_diffusion_grpo_tiny_cpu.py --device cuda
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_tiny_cpu.py --output-dir /tmp/dry
The run writes metrics.jsonl, run.json, curves.png and last_rollout.png to <output-dir>/<run-id>/.
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

from dataclasses import dataclass, field
from typing import Literal

import miles.launcher.recipe_api as U

FAMILY = "sd3"
NUM_PROMPTS = 64


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    num_rollout: int = field(
        default=30, metadata={"help": "Rollouts to train (each: sample, score, train, push the new weights)."}
    )
    train_ranks: int = field(
        default=1, metadata={"help": "Data-parallel CPU train ranks, each with a rollout engine on its slot."}
    )
    device: Literal["cpu", "cuda"] = field(
        default="cpu",
        metadata={"help": "cpu: CPU slots, float32; cuda: one GPU per train rank, bfloat16 compute and rollout."},
    )
    rehearsal: bool = field(
        default=False,
        metadata={"help": "With --device cpu: the cuda layout's settings (bfloat16 compute and rollout) on CPU "
                          "slots, the GPU case's rehearsal."},
    )
    seed: int = field(
        default=1234, metadata={"help": "Seed of the trainer (--seed) and of the rollouts (--rollout-seed)."}
    )
    model_dir: str = U.model_dir_option(
        "Where the tiny checkpoint is created once and reused (shared with other recipes)."
    )
    data_dir: str = U.data_dir_option("Where the prompt file is written.")


def prepare(args: ScriptArgs) -> U.Assets:
    """Make (once) the tiny checkpoint and the colour prompts; a dry run only names them."""
    checkpoint = U.ensure_recipe_checkpoint(FAMILY, "tiny", args.model_dir)
    prompt_data, _ = U.ensure_prompt_files("tiny", args.data_dir, NUM_PROMPTS, eval_prompts=0)
    return U.Assets(checkpoint, prompt_data)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    # a job that shares no block: every block below is this recipe's own; the job joins and launches them
    job = U.TrainJob(__file__, args, num_gpus_per_node=args.train_ranks if args.device == "cuda" else 0)

    ckpt_args = U.ckpt_args(FAMILY, assets.checkpoint, args, save_interval=10)

    rollout_args = (
        U.prompt_batch_args(assets.prompt_data, args.num_rollout, batch_size=4, samples_per_prompt=8, metadata=True,
                            rollout_seed=args.seed)
        + "--diffusion-height 64 --diffusion-width 64 "
        "--diffusion-num-steps 8 --diffusion-num-sde-steps 2 "
        "--diffusion-step-strategy-path sde_window --diffusion-sde-window-max-start 2 "
        "--diffusion-sde-type sde --diffusion-noise-level 1.0 --diffusion-guidance-scale 4.0 "
    )

    eval_args = ""  # the training reward is the signal at this size

    grpo_args = U.flow_grpo_args(clip_range="1e-2")

    optimizer_args = U.optimizer_args(lr="2e-3", weight_decay="0.0")

    lora_args = ""  # full finetune: the tiny transformer is small enough

    reward_args = U.cpu_reward_args("brightness", num_workers=1)

    engine_args = U.engine_args(args.train_ranks)

    if args.rehearsal and args.device != "cpu":
        raise SystemExit("error: --rehearsal rehearses the cuda layout on CPU slots; fix: drop --rehearsal or use "
                         "--device cpu")
    gpu_settings = args.device == "cuda" or args.rehearsal
    dtype = "bfloat16" if gpu_settings else "float32"  # master weights stay float32
    train_backend_args = U.train_backend_args(dtype, update_weights="")

    perf_args = U.tile_args(8)

    misc_args = (
        U.gpu_layout_args(args.device, gpu_memory_gb=None, train_gpus=args.train_ranks, gpus_per_node=args.train_ranks)
        + f"--colocate --seed {args.seed} --deterministic-mode "
        "--diffusion-debug-mode "  # log train/rollout parity (exactly 0.0 when healthy)
    )

    job.execute_train(
        ckpt_args=ckpt_args, rollout_args=rollout_args, eval_args=eval_args, grpo_args=grpo_args,
        optimizer_args=optimizer_args, lora_args=lora_args, reward_args=reward_args, engine_args=engine_args,
        train_backend_args=train_backend_args, perf_args=perf_args, misc_args=misc_args,
    )


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    execute(args, prepare(args))


if __name__ == "__main__":
    main()
