"""The names miles-diffusion's `command_utils` offers launch scripts, with the same meaning here, so
a script written against it runs unmodified (docs/launch-scripts.md, "Bringing a miles-diffusion
recipe"). Names of parts this project does not have (Megatron, mooncake) are refused with one line.

Differences that keep a rule of ours: `hf_download_dataset` fetches into the shared Hugging Face
cache and returns the local path; `execute_train` never puts a secret on a command line, whatever
`extra_env_vars` holds; `get_default_wandb_args` never emits the key (the job reads it from its
environment).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from miles.launcher import train_launch
from miles.launcher.config import REPO_ROOT, ExecuteTrainConfig
from miles.launcher.processes import exec_command as _exec_command
from miles.launcher.recipe_assets import ensure_released_or_exit
from miles.launcher.released_assets import HubAsset, download_failed, ensure_hub_asset, is_offline
from miles.launcher.train_job import get_default_wandb_args as wandb_flags
from miles.launcher.typer_utils import parse_bool_word

repo_base_dir = REPO_ROOT

# GPUs per node and the generation of the accelerators miles' CI names
NUM_GPUS_OF_HARDWARE = {"H100": 8, "H200": 8, "GB200": 4, "GB300": 4}
GENERATION_HARDWARE = {"H100": "Hopper", "H200": "Hopper", "GB200": "Blackwell", "GB300": "Blackwell"}

_WHAT_RUNS_HERE = ("this project trains diffusers-layout checkpoints with its own FSDP/DP train ranks "
                   "(train_diffusion.py); give --hf-checkpoint a diffusers directory or a hub id")


def refuse(name: str, why: str) -> NoReturn:
    """One line on stderr and exit status 2: a name of miles-diffusion with no meaning here."""
    print(f"error: U.{name}: {why}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def exec_command(cmd: str | list[str], capture_output: bool = False, **options: Any) -> Any:
    """`EXEC: <cmd>`, run with bash (printed only in a dry run). With capture_output the command's
    stdout is returned as text, as miles-diffusion's exec_command returns it."""
    result = _exec_command(cmd, capture_output=capture_output, **options)
    return result.stdout if capture_output else result


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """True for 1/true/yes/on (any case); false for 0/false/no/off; anything else is false with a
    warning naming the variable (miles-diffusion's reading of a boolean variable)."""
    raw = os.environ.get(name, default)
    value = parse_bool_word(raw)
    if value is None:
        print(f"warning: {name}={raw!r} is not a boolean (1/0, true/false, yes/no); reading it as false",
              file=sys.stderr, flush=True)
        return False
    return value


def get_env_enable_infinite_run() -> bool:
    return get_bool_env_var("MILES_TEST_ENABLE_INFINITE_RUN", "false")


def check_has_nvlink() -> bool:
    """Whether `nvidia-smi topo -m` shows an NVLink between GPUs; False without nvidia-smi. A read,
    run even in a dry run (it changes nothing)."""
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return topo.returncode == 0 and any(word.startswith("NV") and word[2:].isdigit() for word in topo.stdout.split())


def hf_download_dataset(full_name: str, include: str | None = None, data_dir: str | os.PathLike | None = None, *,
                        local_dir: str | os.PathLike | None = None, revision: str = "main") -> str:
    """Fetch the Hub dataset `org/name` (or only the files matching `include`, e.g. "subset/**";
    resumable, HF_HOME and HF_HUB_OFFLINE honoured) and return its local directory, as
    miles-diffusion's does: `<data_dir>/<name>` when `data_dir` is given, `local_dir` itself when
    that is given, else its snapshot in the shared Hugging Face cache (not /root/datasets). A dry run
    prints the command and names the path."""
    if local_dir is None and data_dir is not None:
        local_dir = Path(data_dir) / full_name.split("/")[-1]
    if local_dir is None:
        dataset = HubAsset(full_name.split("/")[-1], full_name, revision=revision, repo_type="dataset")
        return ensure_released_or_exit(ensure_hub_asset, dataset, include)
    words = ["hf", "download", full_name, "--repo-type", "dataset", "--revision", revision]
    command = shlex.join([*words, *(["--include", include] if include else []), "--local-dir", str(local_dir)])
    if is_offline() and not Path(local_dir).is_dir():
        print(f"error: dataset {full_name} is not in {local_dir} and HF_HUB_OFFLINE=1 forbids fetching it; "
              f"fetch it once online with: {command}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    try:
        _exec_command(command)
    except subprocess.CalledProcessError as err:
        why = "check this host's network and the dataset id; a private or gated dataset needs HF_TOKEN"
        failed = download_failed(f"dataset {full_name}@{revision}", f"`{command}` exited {err.returncode}", why,
                                 f"run that command on a machine that is online and copy {local_dir} to the same "
                                 f"path here")
        print(f"error: {failed}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return str(local_dir)


def rsync_simple(path_src: str, path_dst: str) -> None:
    _exec_command(f"mkdir -p {shlex.quote(path_dst)} && rsync -a --info=progress2 {shlex.quote(path_src)}/ "
                  f"{shlex.quote(path_dst)}")


def save_to_temp_file(text: str, ext: str) -> str:
    """Write `text` to a fresh temporary file and return its path (a config a flag points at)."""
    fd, path = tempfile.mkstemp(prefix="miles_temp_file_", suffix=f".{ext}")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    print(f"wrote {len(text)} characters to {path}", flush=True)
    return path


def convert_checkpoint(*args: Any, **kwargs: Any) -> NoReturn:
    refuse("convert_checkpoint", f"converting to a Megatron torch_dist checkpoint has no meaning here: "
           f"{_WHAT_RUNS_HERE}")


def fp8_cast_bf16(*args: Any, **kwargs: Any) -> NoReturn:
    refuse("fp8_cast_bf16", f"an FP8-to-BF16 cast for Megatron has no meaning here: {_WHAT_RUNS_HERE}; "
           f"pick the dtype with --param-dtype / --compute-dtype")


def refused_name(name: str):
    """A Megatron or mooncake name of miles (not offered here): calling it refuses with one line."""
    part = "Megatron" if "megatron" in name.lower() else "mooncake (the transfer engine of sglang's PD serving)"

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(name, f"{part} does not run here: {_WHAT_RUNS_HERE}")

    refused.__name__ = name
    return refused


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    config: ExecuteTrainConfig | None = None,
    train_script: str = train_launch.DEFAULT_TRAIN_SCRIPT,
    before_ray_job_submit: Any = None,
    extra_env_vars: Mapping[str, str] | None = None,
    megatron_model_type: Any = None,
    **launch_options: Any,
) -> None:
    """miles-diffusion's execute_train: `config` defaults to `ExecuteTrainConfig()`; `extra_env_vars`
    (a dict) joins the job's environment under `config.extra_env_vars` (which wins). Its older form,
    a Megatron model type third (None, or a model type that is refused), works too.
    `launch_options`: our locked_flags, ray_head_port, cluster_wait_timeout."""
    if config is not None and not isinstance(config, ExecuteTrainConfig):
        config, megatron_model_type = None, config  # the older form's third positional
    if megatron_model_type is not None:
        refuse("execute_train", f"megatron_model_type={megatron_model_type!r}: Megatron does not run here: "
               f"{_WHAT_RUNS_HERE}; pass None")
    config = config if config is not None else ExecuteTrainConfig()
    if extra_env_vars:
        config = dataclasses.replace(config, extra_env_vars=_merged_env_text(extra_env_vars, config.extra_env_vars))
    train_launch.execute_train(train_args, num_gpus_per_node, config, train_script=train_script,
                               before_ray_job_submit=before_ray_job_submit, **launch_options)


def get_default_wandb_args(test_file: str, run_name_prefix: str | None = None, run_id: str | None = None,
                           project: str | None = None, **extra_flags: object) -> str:
    """miles-diffusion's wandb flags, only when WANDB_API_KEY is set: group the script's file name,
    run name `[<prefix>_]<group>-<run id>`, project `project` (unset: `$WANDB_PROJECT`, else
    `miles-<script name>`), then each extra flag as `--<name with dashes> <value>`
    (`wandb_log_num_images=8` is `--wandb-log-num-images 8`). Never the key itself: the trainer
    reads it from its environment, where the launcher puts it."""
    words = wandb_flags(test_file, run_name_prefix, run_id, project=project or _default_project(test_file))
    if not words:
        return ""
    if project and "--wandb-project" not in words.split():  # the script's own project wins over $WANDB_PROJECT
        words += " " + shlex.join(["--wandb-project", project])
    extra = [w for name, value in extra_flags.items() for w in (f"--{name.replace('_', '-')}", str(value))]
    return " ".join(filter(None, [words, shlex.join(extra)]))


def _default_project(test_file: str) -> str:
    """miles-diffusion's per-script project: `miles-<stem>`, a stem under 6 letters prefixed by its folder."""
    path = Path(test_file)
    name = path.stem if len(path.stem) >= 6 else f"{path.parent.name}_{path.stem}"
    return f"miles-{name}"


def _merged_env_text(given: Mapping[str, str], text: str) -> str:
    from miles.launcher.env_vars import parse_extra_env_vars

    return json.dumps({**{str(k): str(v) for k, v in given.items()}, **parse_extra_env_vars(text)})


__all__ = [
    "GENERATION_HARDWARE", "NUM_GPUS_OF_HARDWARE", "check_has_nvlink", "convert_checkpoint", "exec_command",
    "execute_train", "fp8_cast_bf16", "get_bool_env_var", "get_default_wandb_args", "get_env_enable_infinite_run",
    "hf_download_dataset", "refused_name", "repo_base_dir", "rsync_simple", "save_to_temp_file",
]
