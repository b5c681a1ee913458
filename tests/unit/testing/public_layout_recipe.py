"""A launch script as a miles-diffusion user writes one (the documented public layout: ScriptArgs on
U.ExecuteTrainConfig, prepare() that downloads the dataset and returns its path, execute() with one
string per flag group, U.execute_train(..., config=args, extra_env_vars=...), typer.run(main)).
Nothing here follows this project's house style; the harness must take it as it is.

    python3 scripts/team/run_public_layout_demo.py --num-rollout 50
"""

from dataclasses import dataclass

import typer

import miles.utils.external_utils.command_utils as U


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    num_rollout: int = 400
    extra_args: str = ""


def prepare(args) -> str:
    return U.hf_download_dataset("my-org/pickscore-prompts")


def execute(args, data_dir) -> None:
    ckpt_args = "--hf-checkpoint stabilityai/stable-diffusion-3.5-medium --diffusion-model-family sd3 "
    rollout_args = (
        f"--prompt-data {data_dir}/train.jsonl --input-key prompt --num-rollout {args.num_rollout} "
        "--rollout-batch-size 8 --n-samples-per-prompt 8 --diffusion-num-steps 10 "
        "--diffusion-sde-window-size 2 --diffusion-sde-window-range 0,3 "
        "--diffusion-guidance-scale 4.5 --diffusion-noise-level 0.7 "
    )
    eval_args = f"--eval-interval 10 --eval-prompt-data pickscore {data_dir}/test.jsonl "
    grpo_args = "--advantage-estimator grpo --diffusion-clip-range 1e-4 --diffusion-adv-clip-max 5.0 "
    optimizer_args = "--lr 3e-4 --adam-beta1 0.9 --adam-beta2 0.999 --weight-decay 1e-4 "
    lora_args = "--use-lora --lora-rank 32 --lora-alpha 64 "
    reward_args = ("--rm-type pickscore --pickscore-model-path yuvalkirstain/PickScore_v1 "
                   "--pickscore-num-workers 1 --pickscore-num-gpus-per-worker 1 ")
    train_backend_args = "--diffusion-forward-dtype bf16 --fsdp-master-dtype fp32 "
    perf_args = "--micro-batch-size-sample 8 --micro-batch-size-tstep 1 --num-steps-per-rollout 2 "
    misc_args = "--actor-num-gpus-per-node 4 --num-gpus-per-node 5 --colocate --offload "
    groups = [ckpt_args, rollout_args, eval_args, grpo_args, optimizer_args, lora_args, reward_args,
              train_backend_args, perf_args, misc_args, U.get_default_wandb_args(__file__), args.extra_args]
    U.execute_train(train_args=" ".join(groups), num_gpus_per_node=5, config=args,
                    extra_env_vars={"NCCL_DEBUG": "WARN"})


@U.dataclass_cli
def main(args: ScriptArgs):
    execute(args, prepare(args))


if __name__ == "__main__":
    typer.run(main)
