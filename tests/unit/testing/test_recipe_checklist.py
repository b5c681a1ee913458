"""docs/launch-scripts.md, "Adding a recipe: checklist", followed literally in a scratch copy of the
repository: a new recipe reaches a passing dry check with no test edit.

The scratch copy holds what the checklist's commands touch: scripts/, tests/e2e/, train_diffusion.py,
conftest.py and pyproject.toml (the `miles` package is the installed one). Every command below is
the checklist's own, run from the scratch repository's root as a user would type it.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHECKLIST = (REPO / "docs" / "launch-scripts.md").read_text().split("## Adding a recipe: checklist", 1)[1]
WHAT = "checklist_demo_cpu"
RECIPE = f"scripts/run_{WHAT}.py"
CLOSEST = "scripts/run_diffusion_grpo_tiny_cpu.py"

NEW_DOCSTRING = '''"""Flow-GRPO on the tiny SD3-family model on CPU, with a learning rate of its own (checklist demo).

What it trains:
    The tiny `sd3` model, built from a seed, learns to paint brighter images (reward `brightness`).

Prerequisites:
    None: prepare() builds the checkpoint and the prompt file locally on first use.

CPU layout:
    one Ray head with CPU slots; one train rank with its rollout engine colocated; no GPU.

Example:
    python3 scripts/run_checklist_demo_cpu.py --lr 1e-3
"""
'''


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "WANDB_", "PYTEST_"))
           and k not in ("RAY_ADDRESS", "ENABLE_RAY_SUBMIT")}
    env.pop("MILES_RESULTS_DIR", None)  # an inner pytest must not write into an outer CI run's records
    return env


def _sh(root: Path, command: str, timeout: int = 60, **extra_env) -> subprocess.CompletedProcess:
    """One checklist command, through bash from the repository root, as a user types it."""
    env = {**_env(), **extra_env}
    # `pytest` as this interpreter's, whatever PATH holds
    command = re.sub(r"^pytest ", f"{shlex.quote(sys.executable)} -m pytest ", command)
    result = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"$ {command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def scratch_repo(tmp_path: Path) -> Path:
    """The catalog, its e2e tests and the harness entry points copied to a scratch repository."""
    root = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("scripts", "tests/e2e"):
        shutil.copytree(REPO / folder, root / folder, ignore=ignore)
    for name in ("train_diffusion.py", "conftest.py", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    return root


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the closest recipe changed: {old!r} not found once"
    return text.replace(old, new)


@pytest.mark.timeout(120)
def test_the_recipe_checklist_taken_literally_reaches_a_passing_dry_check(tmp_path):
    # the steps this test takes are the ones the checklist lists
    for step in ("Copy the closest recipe", "Update the docstring", "ScriptArgs(U.ExecuteTrainConfig)",
                 "locked_flags", "--help", "MILES_SCRIPT_ENABLE_RAY_SUBMIT=0", "--validate-only",
                 "--snapshot-update", "-m dry"):
        assert step in CHECKLIST, step
    root = scratch_repo(tmp_path)

    # 1. copy the closest recipe to scripts/run_<what>.py
    text = (root / CLOSEST).read_text()
    # 2. the docstring
    text = NEW_DOCSTRING + text[text.index('"""', 3) + 3:].lstrip("\n")
    # 3. ScriptArgs: a field with a help text; prepare() stays as it is (dry: paths only)
    text = _edit(text, "    train_ranks: int = field(",
                 '    lr: str = field(default="1e-3", metadata={"help": "Learning rate of the demo."})\n'
                 "    train_ranks: int = field(")
    # 4. execute(): the job, with the flags the results depend on locked, then the flag blocks
    text = _edit(text, 'U.optimizer_args(lr="2e-3"', 'U.optimizer_args(lr=args.lr')
    text = _edit(text, 'num_gpus_per_node=args.train_ranks if args.device == "cuda" else 0)',
                 'num_gpus_per_node=args.train_ranks if args.device == "cuda" else 0,\n'
                 '                     locked_flags=("--diffusion-num-steps",))')
    (root / RECIPE).write_text(text)
    # 5. (a --scale cpu-proxy option is only for recipes that also get a CPU case: not this one)

    # 6. the checklist's own command block, in its order, `<what>` and /tmp/dry replaced
    dry = tmp_path / "dry"
    commands = _checklist_commands(dry)
    assert [c.split()[:3] for c in commands] == [
        ["python3", f"scripts/run_{WHAT}.py", "--help"],
        ["MILES_SCRIPT_ENABLE_RAY_SUBMIT=0", "python3", f"scripts/run_{WHAT}.py"],
        ["python3", "train_diffusion.py", "--validate-only"],
        ["pytest", "tests/e2e", "-m"], ["pytest", "tests/e2e", "-m"]]
    help_run, dry_run, validate, record, check = (_sh(root, c) for c in commands)

    assert "Learning rate of the demo." in help_run.stdout and "MILES_SCRIPT_LR" in help_run.stdout

    plan_path = Path(re.search(r"^plan: (\S+plan\.json)$", dry_run.stdout, re.M).group(1))  # the plan it names
    assert plan_path == dry / "check" / "plan.json"  # where the next command of the block reads it
    plan = json.loads(plan_path.read_text())
    assert plan["argv"][plan["argv"].index("--lr") + 1] == "1e-3"
    assert "--diffusion-num-steps" in plan["locked_flags"]

    assert validate.stdout.startswith("Batch plan") and "samples per rollout" in validate.stdout, validate.stdout

    assert re.search(r"\b1 passed\b", record.stdout), record.stdout[-2000:]
    snapshot = root / "tests" / "e2e" / "__snapshots__" / "test_dry" / f"test_dry[run_{WHAT}-dry].txt"
    assert snapshot.is_file() and "--lr 1e-3" in snapshot.read_text() and "[locked_flags]" in snapshot.read_text()

    assert re.search(r"\b1 passed\b", check.stdout) and "deselected" in check.stdout, check.stdout[-2000:]
    assert "failed" not in check.stdout and "error" not in check.stdout.lower(), check.stdout[-2000:]
    # the other recipes' snapshots were neither rewritten nor removed
    for recorded in (REPO / "tests" / "e2e" / "__snapshots__" / "test_dry").iterdir():
        assert (snapshot.parent / recorded.name).read_text() == recorded.read_text()


def _checklist_commands(dry: Path) -> list[str]:
    """The ```bash block of checklist step 6, one command a line, for this recipe and this dry dir."""
    block = re.search(r"```bash\n(.*?)```", CHECKLIST.split("\n6. ", 1)[1], re.S).group(1)
    return [line.strip().replace("<what>", WHAT).replace("/tmp/dry", str(dry))
            for line in block.splitlines() if line.strip()]
