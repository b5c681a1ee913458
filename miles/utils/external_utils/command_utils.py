"""miles-diffusion's `U`, kept at its import path for launch scripts written against it:

    import miles.utils.external_utils.command_utils as U

Only the names miles-diffusion's current `command_utils` has go through here (docs/launch-scripts.md,
"Bringing a miles-diffusion recipe"); each is the launcher's own (miles.launcher). This repository's
recipes import the whole recipe API, miles.launcher.recipe_api. A Megatron or mooncake name refuses
in one line when called. The layer rule (tests/unit/test_import_layers.py) lets only this file reach
from miles.utils up into the launcher.
"""

from __future__ import annotations

from miles.launcher.config import create_run_id, ExecuteTrainConfig
from miles.launcher.public_names import check_has_nvlink, convert_checkpoint, exec_command, execute_train, fp8_cast_bf16, GENERATION_HARDWARE, get_bool_env_var, get_default_wandb_args, get_env_enable_infinite_run, hf_download_dataset, NUM_GPUS_OF_HARDWARE, repo_base_dir, rsync_simple, save_to_temp_file
from miles.launcher.typer_utils import dataclass_cli
from miles.launcher.public_names import refused_name

__all__ = ["check_has_nvlink", "convert_checkpoint", "create_run_id", "dataclass_cli", "exec_command", "execute_train", "ExecuteTrainConfig", "fp8_cast_bf16", "GENERATION_HARDWARE", "get_bool_env_var", "get_default_wandb_args", "get_env_enable_infinite_run", "hf_download_dataset", "NUM_GPUS_OF_HARDWARE", "repo_base_dir", "rsync_simple", "save_to_temp_file"]


def __getattr__(name: str):
    """`U.convert_megatron_...`, `U.mooncake_...`: calling it refuses with one line; any other unknown
    name is the usual AttributeError."""
    if "megatron" in name.lower() or "mooncake" in name.lower():
        return refused_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
