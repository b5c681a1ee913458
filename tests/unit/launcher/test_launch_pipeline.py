import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.launcher.pipeline import (
    UnknownRecipeError,
    pipeline_state_dir,
    run_pipeline,
    select_recipe,
    sentinel_path,
)

RECIPE = Path(__file__).with_name("example_recipe.py")


def _steps(calls, fail_at=None):
    def step(name):
        def run():
            calls.append(name)
            if name == fail_at:
                raise KeyboardInterrupt  # what an interrupted step looks like to the pipeline
        return run

    return [(name, step(name)) for name in ("prepare-data", "prepare-checkpoint", "train")]


def test_rerun_after_completion_skips_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", raising=False)
    calls = []
    run_pipeline(_steps(calls), tmp_path)
    assert run_pipeline(_steps(calls), tmp_path) == []
    assert calls == ["prepare-data", "prepare-checkpoint", "train"]


def test_rerun_after_interruption_resumes_at_the_interrupted_step(tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", raising=False)
    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(_steps(calls, fail_at="prepare-checkpoint"), tmp_path)
    assert sentinel_path(tmp_path, "prepare-data").exists()
    assert not sentinel_path(tmp_path, "prepare-checkpoint").exists()
    assert run_pipeline(_steps(calls), tmp_path) == ["prepare-checkpoint", "train"]


def test_dry_run_pipeline_writes_no_sentinels(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    run_pipeline(_steps([]), tmp_path)
    assert not any(tmp_path.iterdir())


def test_select_recipe_names_the_option_and_the_choices():
    table = {"tiny-a": 1, "tiny-b": 2}
    assert select_recipe(table, "tiny-b") == 2
    with pytest.raises(UnknownRecipeError, match="--model-name 'big' is not one of: tiny-a, tiny-b"):
        select_recipe(table, "big")


def _recipe(*argv, dry=False, **env):
    environ = {**os.environ, **env}
    environ.pop("WANDB_API_KEY", None)
    if dry:
        environ["MILES_SCRIPT_ENABLE_RAY_SUBMIT"] = "0"
    return subprocess.run([sys.executable, str(RECIPE), *argv], capture_output=True, text=True, env=environ)


def test_full_train_resumes_at_the_step_after_the_last_completed_one(tmp_path):
    out = str(tmp_path / "out")
    failed = _recipe("full-train", "--output-dir", out, "--fail-step", "prepare-checkpoint")
    assert failed.returncode != 0
    state = pipeline_state_dir(out)
    assert sentinel_path(state, "prepare-data").exists()
    assert not sentinel_path(state, "prepare-checkpoint").exists()

    resumed = _recipe("full-train", "--output-dir", out, "--fail-step", "train")
    assert "step prepare-data already done" in resumed.stdout
    assert "running step prepare-checkpoint" in resumed.stdout and resumed.returncode != 0
    assert sentinel_path(state, "prepare-checkpoint").exists()

    # a train script of its own: the preflight would refuse the example's text-file checkpoint
    (tmp_path / "never_runs.py").write_text("raise SystemExit('a dry run runs no train script')\n")
    rerun = _recipe("full-train", "--output-dir", out, "--train-script", str(tmp_path / "never_runs.py"), dry=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "step prepare-data already done" in rerun.stdout
    assert "step prepare-checkpoint already done" in rerun.stdout
    assert "running step train (dry run)" in rerun.stdout and "EXEC: ray job submit" in rerun.stdout
