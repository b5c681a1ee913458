"""A recipe's launch as one object, built at the top of its execute(): the flag blocks its kind of
recipe writes the same way, and how the job starts. `execute_train()` takes the blocks that make
the recipe that recipe, joins them with the job's in the canonical order and launches:

    job = U.colocated_job(__file__, args, assets, FAMILY, scale, GPU_MEMORY_GB)
    rollout_args = ...  # grpo_args, optimizer_args, lora_args, perf_args
    job.execute_train(rollout_args=rollout_args, grpo_args=grpo_args, ...)

FLAG_BLOCKS is the order of the flags on the train_diffusion.py command line whatever order the
blocks are given in: the dry-run snapshots record that order.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from miles.launcher.config import ExecuteTrainConfig
from miles.launcher.flag_blocks import (
    ckpt_args,
    colocated_misc_args,
    engine_args,
    eval_args,
    pickscore_args,
    train_backend_args,
)
from miles.launcher.recipe_assets import Assets
from miles.launcher.recipe_options import ColocatedScale, RolloutScale
from miles.launcher.train_launch import execute_train

FLAG_BLOCKS = (
    "ckpt_args", "rollout_args", "eval_args", "grpo_args", "optimizer_args", "lora_args", "reward_args",
    "engine_args", "train_backend_args", "perf_args", "misc_args",
)
SHARED_BLOCKS = ("ckpt_args", "eval_args", "reward_args", "engine_args", "train_backend_args", "misc_args")
# what makes a recipe that recipe: its sampler, loss, learning rate, LoRA and tiling, always its own
RECIPE_BLOCKS = tuple(name for name in FLAG_BLOCKS if name not in SHARED_BLOCKS)


def get_default_wandb_args(
    test_file: str, run_name_prefix: str | None = None, run_id: str | None = None, *, project: str = "miles-diffusion"
) -> str:
    """wandb flags for train_diffusion.py, only when WANDB_API_KEY is set (miles-diffusion's
    signature): group the recipe's file name, run name `[<prefix>_]<group>-<run id>`. Never the key
    itself: the trainer reads it from its environment, where the launcher puts it."""
    if not os.environ.get("WANDB_API_KEY"):
        return ""
    group = Path(test_file).stem
    words = ["--use-wandb", "--wandb-group", group]
    if not os.environ.get("WANDB_PROJECT"):  # wandb's own variable wins over the recipe's default
        words += ["--wandb-project", project]
    if run_id or run_name_prefix:
        name = f"{group}-{run_id}" if run_id else group
        words += ["--wandb-run-name", f"{run_name_prefix}_{name}" if run_name_prefix else name]
    return shlex.join(words)


@dataclass(frozen=True)
class TrainJob:
    """The shared flag blocks of one launch, and what U.execute_train needs besides the flags.
    A bare TrainJob shares nothing: its recipe gives every block itself."""

    recipe: str  # the recipe's __file__: its file name is the wandb group
    config: ExecuteTrainConfig
    num_gpus_per_node: int  # GPUs the Ray head offers; 0 for a CPU job
    ckpt_args: str = ""
    eval_args: str = ""
    reward_args: str = ""
    engine_args: str = ""
    train_backend_args: str = ""
    misc_args: str = ""
    # passed on to U.execute_train as they are
    locked_flags: Iterable[str] | Mapping[str, str] | None = ()
    before_ray_job_submit: Callable[..., Any] | None = None
    ray_head_port: int | None = None

    def train_args(self, **blocks: str) -> str:
        """Every block in FLAG_BLOCKS order, then the wandb flags. `blocks` holds at least the
        recipe's own (RECIPE_BLOCKS); a shared block given here replaces the job's."""
        missing = [name for name in RECIPE_BLOCKS if name not in blocks]
        unknown = [name for name in blocks if name not in FLAG_BLOCKS]
        if missing or unknown:
            raise TypeError(f"train_args: missing the recipe's blocks {missing}, unknown blocks {unknown}; "
                            f"the blocks are {', '.join(FLAG_BLOCKS)}")
        blocks = {name: getattr(self, name) for name in SHARED_BLOCKS} | blocks
        wandb_args = get_default_wandb_args(self.recipe, run_id=self.config.run_id)
        return " ".join([*(blocks[name] for name in FLAG_BLOCKS), wandb_args])

    def execute_train(self, **blocks: str) -> None:
        """Launch train_diffusion.py with train_args(**blocks), as U.execute_train does."""
        execute_train(train_args=self.train_args(**blocks), num_gpus_per_node=self.num_gpus_per_node,
                      config=self.config, locked_flags=self.locked_flags,
                      before_ray_job_submit=self.before_ray_job_submit, ray_head_port=self.ray_head_port)


def colocated_job(
    recipe: str, config: ExecuteTrainConfig, assets: Assets, family: str, scale: ColocatedScale | RolloutScale,
    gpu_memory_gb: Optional[int], *, train_gpus: Optional[int] = None, gpus_per_node: Optional[int] = None,
    train_nodes: int = 1, job_nodes: Optional[int] = None, **launch_options: Any,
) -> TrainJob:
    """A job whose train ranks each share a GPU with a rollout engine (--colocate), training
    `transformer` in the scale's dtype and sharding, scored by PickScore when the assets hold it.

    train_gpus: per train node, unset the scale's train_ranks; gpus_per_node: what each node offers,
    unset the train GPUs and the reward's own; job_nodes: set for a multi-node job (a reward node of
    its own counted). launch_options: TrainJob's locked_flags, before_ray_job_submit, ray_head_port."""
    train_gpus = scale.train_ranks if train_gpus is None else train_gpus
    gpus_per_node = train_gpus + scale.separate_reward_gpus if gpus_per_node is None else gpus_per_node
    return TrainJob(
        recipe, config, scale.ray_gpus(gpus_per_node),
        ckpt_args=ckpt_args(family, assets.checkpoint, config, scale.save_interval),
        eval_args=eval_args(assets.eval_prompt_data, scale.eval_interval, scale.eval_prompts,
                            scale.eval_before_train),
        reward_args=pickscore_args(assets.pickscore, scale) if assets.pickscore else "",
        engine_args=engine_args(train_nodes * train_gpus),
        train_backend_args=train_backend_args(scale.dtype, sharded=scale.sharded),
        misc_args=colocated_misc_args(scale, gpu_memory_gb, train_gpus, gpus_per_node, train_nodes=train_nodes,
                                      job_nodes=job_nodes),
        **launch_options,
    )
