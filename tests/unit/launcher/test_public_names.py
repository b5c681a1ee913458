"""miles-diffusion's launcher names, used as its launch scripts use them: a script in the public
layout (tests/unit/testing/public_layout_recipe.py) runs unmodified, and each name keeps its meaning."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import miles.utils.external_utils.command_utils as U

PUBLIC_RECIPE = Path(__file__).resolve().parents[1] / "testing" / "public_layout_recipe.py"
KEY = "wandb-key-never-in-argv-5c1d"


def _run_public_recipe(tmp_path, *argv, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "HF_", "WANDB_"))}
    environ.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "HOME": str(tmp_path / "home"), "COLUMNS": "200", **env})
    return subprocess.run([sys.executable, str(PUBLIC_RECIPE), "--output-dir", str(tmp_path / "out"),
                           "--run-id", "r1", *argv], env=environ, capture_output=True, text=True, timeout=60)


def test_a_public_layout_script_dry_runs_unmodified_with_its_download_env_and_wandb_but_no_key(tmp_path):
    result = _run_public_recipe(tmp_path, "--num-rollout", "7", WANDB_API_KEY=KEY)
    assert result.returncode == 0, result.stderr
    plan_text = (tmp_path / "out" / "r1" / "plan.json").read_text()
    plan = json.loads(plan_text)
    cache = tmp_path / "home" / ".cache" / "huggingface" / "hub"
    assert plan["prepare_commands"][0] == (f"hf download my-org/pickscore-prompts --revision main --repo-type dataset "
                                           f"--cache-dir {cache}")
    assert plan["runtime_env"]["env_vars"]["NCCL_DEBUG"] == "WARN"  # execute_train(extra_env_vars=...)
    argv = plan["argv"]
    assert argv[argv.index("--hf-checkpoint") + 1].startswith(str(cache / "models--stabilityai--"))
    assert "--use-wandb" in argv and argv[argv.index("--num-rollout") + 1] == "7"
    assert KEY not in plan_text + result.stdout + result.stderr


def test_typer_run_keeps_each_options_default_and_variable_in_help(tmp_path):
    result = _run_public_recipe(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    assert "default: 400; env MILES_SCRIPT_NUM_ROLLOUT" in " ".join(result.stdout.split())


def test_get_default_wandb_args_takes_prefix_then_run_id_and_never_the_key(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert U.get_default_wandb_args("scripts/run_x.py", "nightly", "r9") == ""
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    words = U.get_default_wandb_args("scripts/run_x.py", "nightly", "r9").split()
    assert words[words.index("--wandb-run-name") + 1] == "nightly_run_x-r9"
    assert words[words.index("--wandb-group") + 1] == "run_x" and KEY not in " ".join(words)
    assert "--wandb-run-name" not in U.get_default_wandb_args("scripts/run_x.py")


@pytest.mark.parametrize("raw, expected", [("1", True), ("TRUE", True), ("0", False), ("false", False)])
def test_get_bool_env_var_reads_the_usual_words(monkeypatch, raw, expected):
    monkeypatch.setenv("X_FLAG", raw)
    assert U.get_bool_env_var("X_FLAG") is expected


def test_get_bool_env_var_reads_other_words_as_false_with_a_warning(monkeypatch, capsys):
    monkeypatch.setenv("X_FLAG", "maybe")
    assert U.get_bool_env_var("X_FLAG") is False and "X_FLAG" in capsys.readouterr().err
    monkeypatch.delenv("X_FLAG")
    assert U.get_bool_env_var("X_FLAG", "1") is True


@pytest.mark.parametrize("call", [
    lambda: U.convert_checkpoint("GLM-4", "glm4", 8),
    lambda: U.fp8_cast_bf16("a", "b"),
    lambda: U.setup_mooncake_transfer_engine(),
    lambda: U.execute_train("--lr 1e-5", 8, "deepseek-v3"),
])
def test_megatron_and_mooncake_names_are_refused_with_one_line(call, capsys):
    with pytest.raises(SystemExit) as exit_info:
        call()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1
    assert "does not run here" in lines[0] or "no meaning here" in lines[0]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError):
        U.no_such_helper  # noqa: B018


@dataclasses.dataclass
class _CountArgs:
    count: int = 1


def test_dataclass_cli_reads_the_environment_under_env_var_prefix():
    seen = []

    def main(args: _CountArgs) -> None:
        seen.append(args.count)

    app = typer.Typer()
    app.command()(U.dataclass_cli(main, env_var_prefix="MY_APP_", print_table=False))
    result = CliRunner().invoke(app, [], env={"MY_APP_COUNT": "7", "MILES_SCRIPT_COUNT": "3"})
    assert result.exit_code == 0, result.output
    assert seen == [7]


def test_check_has_nvlink_is_false_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert U.check_has_nvlink() is False


def test_cuda_core_dump_puts_the_dump_variables_into_the_jobs_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    for core_dump in (False, True):
        config = U.ExecuteTrainConfig(output_dir=str(tmp_path), run_id=f"d{int(core_dump)}", cuda_core_dump=core_dump)
        U.execute_train("--hf-checkpoint x --diffusion-model-family sd3 --rm-type brightness --prompt-data p "
                        "--num-rollout 1 --device cpu --colocate --num-gpus-per-node 1", 0, config=config,
                        extra_env_vars={"FROM_RECIPE": "1"})
    env = {run: json.loads((tmp_path / run / "plan.json").read_text())["runtime_env"]["env_vars"] for run in ("d0", "d1")}
    assert "CUDA_COREDUMP_FILE" not in env["d0"] and env["d0"]["FROM_RECIPE"] == "1"
    assert env["d1"]["CUDA_COREDUMP_FILE"].startswith(str(tmp_path / "d1"))
    assert env["d1"]["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
