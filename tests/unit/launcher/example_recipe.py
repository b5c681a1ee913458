"""A small recipe in every launcher shape, for the launcher's tests (real recipes live in scripts/).

    python3 example_recipe.py train --model-name tiny-b --num-rollout 5
    python3 example_recipe.py full-train            # prepare-data, prepare-checkpoint, train
    python3 example_recipe.py worker --head-address 127.0.0.1:6379
    python3 example_recipe.py train --num-nodes 2 --ray-head-port 6379

It writes its "assets" as small text files, and by default trains with whatever --train-script
names, so tests can hand it a tiny script instead of train_diffusion.py.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import miles.launcher.recipe_api as U


@dataclass(frozen=True)
class _Recipe:
    diffusion_num_steps: int
    lr: str


_RECIPES = {
    "tiny-a": _Recipe(diffusion_num_steps=8, lr="3e-4"),
    "tiny-b": _Recipe(diffusion_num_steps=4, lr="1e-4"),
}
_MODEL_NAMES = Literal["tiny-a", "tiny-b"]
_STEPS = ("prepare-data", "prepare-checkpoint", "train")

LOCKED_FLAGS = ("--diffusion-num-steps",)


@dataclass
class ScriptArgs(U.ExecuteTrainConfig):
    model_name: _MODEL_NAMES = field(default="tiny-a", metadata={"help": "Which entry of _RECIPES to run."})
    num_rollout: int = field(default=3, metadata={"help": "Rollouts to train."})
    num_gpus_per_node: int = field(default=0, metadata={"help": "GPUs per node; 0 is a CPU job."})
    use_ema: bool = field(default=False, metadata={"help": "Keep an EMA copy of the weights."})
    train_script: str = field(default="train_diffusion.py", metadata={"help": "The script the job runs."})
    ray_head_port: int = field(default=0, metadata={"help": "GCS port of the head (0: any free port)."})
    fail_step: str = field(default="", metadata={"help": "For tests: this pipeline step raises."})


@dataclass
class WorkerArgs:
    head_address: str = field(metadata={"help": "host:port of the head's GCS."})
    output_dir: str = field(
        default=str(U.REPO_ROOT / "logs"), metadata={"help": "Where the worker records what it starts."}
    )
    num_gpus: int = field(default=0, metadata={"help": "GPUs this node offers."})
    num_cpus: int = field(default=1, metadata={"help": "CPUs this node offers."})


def _assets_dir(args: ScriptArgs) -> Path:
    return Path(args.output_dir) / "assets"


def _maybe_fail(args: ScriptArgs, step: str) -> None:
    if args.fail_step == step:
        raise RuntimeError(f"step {step} failed (--fail-step)")


def prepare_data(args: ScriptArgs) -> None:
    """Write the prompt file."""
    _maybe_fail(args, "prepare-data")
    if not U.is_dry_run():
        _assets_dir(args).mkdir(parents=True, exist_ok=True)
        (_assets_dir(args) / "prompts.jsonl").write_text('{"prompt": "a red square"}\n')


def prepare_checkpoint(args: ScriptArgs) -> None:
    """Write the checkpoint marker."""
    _maybe_fail(args, "prepare-checkpoint")
    if not U.is_dry_run():
        _assets_dir(args).mkdir(parents=True, exist_ok=True)
        (_assets_dir(args) / "checkpoint.txt").write_text(f"{args.model_name}\n")


def _announce(cluster: U.ClusterInfo) -> None:
    """The before_ray_job_submit hook: runs once the cluster is up, right before submitting."""
    print(f"before submit: job server {cluster.job_server_url}, run dir {cluster.run_dir}", flush=True)


def train(args: ScriptArgs) -> None:
    """Assemble the flags and submit the job."""
    _maybe_fail(args, "train")
    recipe = U.select_recipe(_RECIPES, args.model_name)
    ckpt_args = f"--hf-checkpoint {_assets_dir(args) / 'checkpoint.txt'} --diffusion-model-family sd3 "
    rollout_args = f"--prompt-data {_assets_dir(args) / 'prompts.jsonl'} --num-rollout {args.num_rollout} "
    sampling_args = f"--diffusion-num-steps {recipe.diffusion_num_steps} --diffusion-kl-beta 0.0 "
    optimizer_args = f"--lr {recipe.lr} " + ("--use-ema " if args.use_ema else "")
    misc_args = f"--device cpu --num-gpus-per-node {max(args.num_gpus_per_node, 1)} --colocate --rm-type brightness "
    train_args = " ".join(
        [ckpt_args, rollout_args, sampling_args, optimizer_args, misc_args,
         U.get_default_wandb_args(__file__, run_id=args.run_id)]
    )
    U.execute_train(
        train_args, args.num_gpus_per_node, args, locked_flags=LOCKED_FLAGS,
        train_script=args.train_script, ray_head_port=args.ray_head_port or None, before_ray_job_submit=_announce,
    )


def full_train(args: ScriptArgs) -> None:
    """prepare-data, prepare-checkpoint and train; a re-run skips the steps already done."""
    steps = dict(zip(_STEPS, (prepare_data, prepare_checkpoint, train), strict=True))
    U.run_pipeline([(name, lambda fn=fn: fn(args)) for name, fn in steps.items()],
                   U.pipeline_state_dir(args.output_dir))


def worker(args: WorkerArgs) -> None:
    """Join the head as another Ray node and block until interrupted or the head goes away."""
    status = U.start_ray_worker(args.head_address, output_dir=args.output_dir,
                                num_gpus=args.num_gpus, num_cpus=args.num_cpus)
    raise SystemExit(status)


app = U.dataclass_cli_app(prepare_data, prepare_checkpoint, train, full_train, worker, help=__doc__)

if __name__ == "__main__":
    app()
