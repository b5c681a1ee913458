"""miles-diffusion's current `command_utils` (its `U`), name by name: each has miles-diffusion's
signature here (its parameters in order, their defaults where the meaning is the same) and does
what the launch scripts rely on; the older forms keep working. The table is docs/launch-scripts.md's."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

import miles.utils.external_utils.command_utils as U

EMPTY = inspect.Parameter.empty
# name -> miles-diffusion's parameters, in order, with their defaults (EMPTY: none; None where ours
# differs in value but not in meaning is listed in DEFAULT_DIFFERS)
UPSTREAM = {
    "hf_download_dataset": [("full_name", EMPTY), ("include", None), ("data_dir", "/root/datasets")],
    "execute_train": [("train_args", EMPTY), ("num_gpus_per_node", EMPTY), ("config", None),
                      ("train_script", "train_diffusion.py"), ("before_ray_job_submit", None),
                      ("extra_env_vars", None)],
    "get_default_wandb_args": [("test_file", EMPTY), ("run_name_prefix", None), ("run_id", None), ("project", None)],
    "create_run_id": [],
    "get_bool_env_var": [("name", EMPTY), ("default", "false")],
    "check_has_nvlink": [],
    "exec_command": [("cmd", EMPTY), ("capture_output", False)],
}
# data_dir: unset here means the shared Hugging Face cache, not /root/datasets (docs/launch-scripts.md)
DEFAULT_DIFFERS = {("hf_download_dataset", "data_dir"): None}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_each_name_takes_miles_diffusions_parameters_in_its_order(name):
    params = list(inspect.signature(getattr(U, name)).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for (want, default), got in zip(UPSTREAM[name], positional):
        assert got.name == want, (name, [p.name for p in positional])
        assert got.default == DEFAULT_DIFFERS.get((name, want), default), (name, want, got.default)
    assert len(positional) >= len(UPSTREAM[name])
    if name == "get_default_wandb_args":
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD  # **extra_flags


def test_execute_train_config_has_miles_diffusions_fields_with_their_defaults():
    fields = {f.name: f for f in dataclasses.fields(U.ExecuteTrainConfig)}
    assert {"cuda_core_dump", "num_nodes", "cuda_visible_devices", "extra_env_vars", "output_dir"} <= set(fields)
    config = U.ExecuteTrainConfig()
    assert (config.cuda_core_dump, config.cuda_visible_devices, config.extra_env_vars) == (False, "", "")
    assert config.output_dir == str(U.repo_base_dir / "logs") and U.repo_base_dir == Path(U.__file__).parents[3]


def test_hf_download_dataset_fetches_the_included_files_into_data_dir_and_returns_that_directory(monkeypatch, tmp_path,
                                                                                                 capsys):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    local = U.hf_download_dataset("rockdu/miles-diffusion-datasets", include="flowgrpo_ocr/**", data_dir=str(tmp_path))
    assert local == str(tmp_path / "miles-diffusion-datasets")
    assert (f"EXEC: hf download rockdu/miles-diffusion-datasets --repo-type dataset --revision main --include "
            f"'flowgrpo_ocr/**' --local-dir {tmp_path / 'miles-diffusion-datasets'}") in capsys.readouterr().out
    # positional, as miles-diffusion's scripts also call it
    assert U.hf_download_dataset("org/sets", "a/**", str(tmp_path)) == str(tmp_path / "sets")
    # the older keywords: a directory of one's own, or a revision into the shared cache
    assert U.hf_download_dataset("org/sets", local_dir=str(tmp_path / "mine")) == str(tmp_path / "mine")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cached = U.hf_download_dataset("org/sets", revision="v2")
    assert cached == str(tmp_path / "hf" / "hub" / "datasets--org--sets" / "snapshots" / "v2")


def test_hf_download_dataset_offline_without_the_data_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stopped:
        U.hf_download_dataset("org/sets", include="x/**", data_dir=str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "HF_HUB_OFFLINE=1" in err[0] and "--include" in err[0]


def test_get_default_wandb_args_takes_project_and_extra_flags_as_miles_diffusions_and_never_the_key(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert U.get_default_wandb_args("scripts/run_diffusion_x.py", run_id="r1", project="p", wandb_log_num_images=8) == ""
    monkeypatch.setenv("WANDB_API_KEY", "key-5c1d")
    words = U.get_default_wandb_args("scripts/run_diffusion_x.py", run_id="r1", project="miles-diffusion-nft",
                                     wandb_log_num_images=8, wandb_log_image_interval=10).split()
    assert words[words.index("--wandb-project") + 1] == "miles-diffusion-nft"
    assert words[-4:] == ["--wandb-log-num-images", "8", "--wandb-log-image-interval", "10"]
    assert "key-5c1d" not in " ".join(words)
    default = U.get_default_wandb_args("scripts/run_x.py").split()
    assert default[default.index("--wandb-project") + 1] == "miles-scripts_run_x"  # miles-diffusion's rule
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert "--wandb-project" not in U.get_default_wandb_args("scripts/run_x.py")  # wandb's own variable decides
    assert "miles-diffusion-nft" in U.get_default_wandb_args("scripts/run_x.py", project="miles-diffusion-nft")


ARGV = ("--hf-checkpoint x --diffusion-model-family sd3 --rm-type brightness --prompt-data p --num-rollout 1 "
        "--device cpu --colocate --num-gpus-per-node 1")


def _plan(tmp_path, run_id: str) -> dict:
    return json.loads((tmp_path / run_id / "plan.json").read_text())


def test_execute_train_takes_config_third_a_dict_of_env_vars_and_its_older_forms(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    config = lambda run: U.ExecuteTrainConfig(output_dir=str(tmp_path), run_id=run)  # noqa: E731
    U.execute_train(ARGV, 0, config("third"), "train_diffusion.py", None, {"FROM_RECIPE": "1"})
    U.execute_train(ARGV, 0, megatron_model_type=None, config=config("older"))  # the older keywords
    U.execute_train(train_args=ARGV, num_gpus_per_node=0, config=config("keywords"), extra_env_vars={"A": "b"})
    assert _plan(tmp_path, "third")["runtime_env"]["env_vars"]["FROM_RECIPE"] == "1"
    assert _plan(tmp_path, "older")["argv"][2:] == _plan(tmp_path, "third")["argv"][2:]  # after --run-dir
    assert _plan(tmp_path, "keywords")["runtime_env"]["env_vars"]["A"] == "b"
    with pytest.raises(SystemExit) as refused:
        U.execute_train(ARGV, 0, "flux")  # the older form's Megatron model type, third
    assert refused.value.code == 2 and "Megatron does not run here" in capsys.readouterr().err


def test_create_run_id_is_unique_and_sortable():
    first, second = U.create_run_id(), U.create_run_id()
    assert first != second and len(first) == len(second) and first[:15] <= second[:15]


def test_the_facade_holds_exactly_the_names_of_the_docs_table():
    doc = (Path(U.__file__).parents[3] / "docs" / "launch-scripts.md").read_text()
    table = doc[doc.index("`U`, miles-diffusion's current names"):doc.index("A real launch checks everything")]
    assert sorted(U.__all__) == sorted(set(re.findall(r"`U\.(\w+)", table)))
    assert not hasattr(U, "TrainJob") and not hasattr(U, "ensure_assets")  # the recipe API stays in the launcher
