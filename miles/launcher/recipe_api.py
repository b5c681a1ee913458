"""The launcher recipes use as `U`: script options (`dataclass_cli`, `ExecuteTrainConfig`) and
`execute_train`, which starts a Ray cluster of its own and submits `train_diffusion.py` to it as
a Ray job. The pieces live in sibling modules; this one gathers what recipes call.

    import miles.launcher.recipe_api as U

Nothing here imports torch or Ray at module level: a dry run (MILES_SCRIPT_ENABLE_RAY_SUBMIT=0)
must stay fast and side-effect free. See docs/launch-scripts.md.

What scaled recipes share lives in recipe_options (the `_Scale` base and `ScaledRecipeArgs`, the
base of their ScriptArgs), recipe_assets (checkpoint, PickScore, prompt files), flag_blocks (the
parts of a block) and train_job (the blocks a kind of recipe shares, joined and launched).

miles-diffusion's own names (`hf_download_dataset`, `execute_train(..., extra_env_vars=...)` with
`config` optional, `get_bool_env_var`, `check_has_nvlink`, `repo_base_dir`, ...) come from
public_names, so a launch script written against it runs here unmodified; a Megatron or mooncake
name is refused with one line when called.
"""

from __future__ import annotations

from miles.launcher.config import REPO_ROOT, ExecuteTrainConfig, create_run_id
from miles.launcher.flag_blocks import (
    ckpt_args,
    colocated_misc_args,
    cpu_reward_args,
    deterministic_args,
    engine_args,
    eval_args,
    flat_micro_batch_args,
    flow_grpo_args,
    gpu_layout_args,
    gradient_checkpointing_args,
    optimizer_args,
    pickscore_args,
    prompt_batch_args,
    rollout_batch_args,
    run_dir,
    tile_args,
    train_backend_args,
)
from miles.launcher.launch_mode import is_dry_run, is_external_ray
from miles.launcher.local_cluster import start_ray_worker
from miles.launcher.pipeline import pipeline_state_dir, run_pipeline, select_recipe
from miles.launcher.plan import read_plan
from miles.launcher.public_names import (
    GENERATION_HARDWARE,
    NUM_GPUS_OF_HARDWARE,
    check_has_nvlink,
    convert_checkpoint,
    exec_command,
    execute_train,
    fp8_cast_bf16,
    get_bool_env_var,
    get_default_wandb_args,
    get_env_enable_infinite_run,
    hf_download_dataset,
    refused_name,
    repo_base_dir,
    rsync_simple,
    save_to_temp_file,
)
from miles.launcher.recipe_assets import (
    Assets,
    ensure_assets,
    ensure_pickscore,
    ensure_prompt_files,
    ensure_recipe_checkpoint,
)
from miles.launcher.recipe_options import (
    CPU_PROXY,
    CPU_REHEARSAL,
    FULL_SCALE,
    ColocatedScale,
    GPU_PROXY,
    RolloutScale,
    Scale,
    ScaledRecipeArgs,
    data_dir_option,
    model_dir_option,
    num_rollout_option,
    rehearsal_scale,
    scale_option,
)
from miles.launcher.ray_cluster import wait_for_cluster_resources
from miles.launcher.train_job import TrainJob, colocated_job
from miles.launcher.launch_run import ClusterInfo
from miles.launcher.train_launch import LaunchError
from miles.launcher.typer_utils import dataclass_cli, dataclass_cli_app, print_options_table

__all__ = [
    "REPO_ROOT", "ClusterInfo", "ExecuteTrainConfig", "LaunchError", "create_run_id", "dataclass_cli",
    "dataclass_cli_app", "exec_command", "execute_train", "get_default_wandb_args", "is_dry_run",
    "is_external_ray", "pipeline_state_dir", "print_options_table", "read_plan", "run_pipeline",
    "select_recipe", "start_ray_worker", "wait_for_cluster_resources",
    # a recipe's scales, options and assets
    "CPU_PROXY", "CPU_REHEARSAL", "FULL_SCALE", "GPU_PROXY", "Assets", "ColocatedScale", "RolloutScale", "Scale", "ScaledRecipeArgs",
    "data_dir_option", "ensure_assets", "ensure_pickscore", "ensure_prompt_files", "ensure_recipe_checkpoint",
    "model_dir_option", "num_rollout_option", "rehearsal_scale", "scale_option",
    # the launch: the blocks recipes of a kind share, joined with the recipe's own
    "TrainJob", "colocated_job",
    # the parts of the flag blocks every recipe writes the same way
    "ckpt_args", "colocated_misc_args", "cpu_reward_args", "deterministic_args", "engine_args", "eval_args",
    "flat_micro_batch_args",
    "flow_grpo_args", "gpu_layout_args", "gradient_checkpointing_args", "optimizer_args", "pickscore_args",
    "prompt_batch_args", "rollout_batch_args", "run_dir", "tile_args", "train_backend_args",
    # miles-diffusion's names, same meaning (public_names)
    "GENERATION_HARDWARE", "NUM_GPUS_OF_HARDWARE", "check_has_nvlink", "convert_checkpoint", "fp8_cast_bf16",
    "get_bool_env_var", "get_env_enable_infinite_run", "hf_download_dataset", "repo_base_dir", "rsync_simple",
    "save_to_temp_file",
]


def __getattr__(name: str):
    """A Megatron or mooncake name of miles (`U.convert_megatron_...`, `U.mooncake_...`): calling it
    refuses with one line; any other unknown name is the usual AttributeError."""
    if "megatron" in name.lower() or "mooncake" in name.lower():
        return refused_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

