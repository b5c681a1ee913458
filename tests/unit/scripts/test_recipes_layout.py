"""Every recipe of the catalog (CATALOG: the recipes this project ships and maintains) is laid out
the same way, and every scale of it assembles flags that train_diffusion.py accepts. A recipe a user
adds under scripts/ is not held to this house style: the harness judges it (tests/e2e/test_dry.py
dry-runs it, validates its argv and keeps its snapshot).

Layout: a module docstring (what it trains, prerequisites, the layout, a runnable example),
`ScriptArgs` (on `U.ScaledRecipeArgs` for a recipe with scales, else `U.ExecuteTrainConfig`) with
help on every option, `prepare()`, `execute()` and `main()` decorated with `@U.dataclass_cli`.
execute() builds one job (`U.colocated_job` or `U.TrainJob`), which owns the flag blocks the
recipe shares with its kind, names the recipe's own blocks (its sampler, loss, learning rate, LoRA,
tiling) and ends by handing each of them, by name, to `job.execute_train`. The argv check runs each
recipe's own prepare() and execute() in process, in a dry run, with `execute_train` replaced by a
recorder, and validates what it was given with `miles.flags.arguments.validate_argv`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# the catalog (DESIGN section 6); a recipe added here is held to the house style below
CATALOG = (
    "run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py",
    "run_diffusion_grpo_ltx23_sglang.py",
    "run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py",
    "run_diffusion_grpo_sd3_ocr_sglang.py",
    "run_diffusion_grpo_tiny_cpu.py",
    "run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py",
    "run_diffusion_grpo_wan22_pickscore_5gpu.py",
    "run_diffusion_nft_sd3_pickscore.py",
    "run_diffusion_sft_wan22.py",
)
RECIPES = [REPO / "scripts" / name for name in CATALOG]
SCALES = ("full", "gpu-proxy", "cpu-proxy")  # every scaled recipe has these three
# a recipe may add a scale of its own: 1gpu-proxy for ci/gpu_check.sh, cpu-rehearsal(-fsdp) for the
# GPU settings rehearsed on CPU slots (issue 39)
EXTRA_SCALES = ("1gpu-proxy", "cpu-rehearsal", "cpu-rehearsal-fsdp")
FLAG_BLOCKS = (
    "ckpt_args", "rollout_args", "eval_args", "grpo_args", "optimizer_args", "lora_args", "reward_args",
    "engine_args", "train_backend_args", "perf_args", "misc_args",
)
# named in every recipe's execute(); the other blocks come from its job unless the recipe names them too
RECIPE_BLOCKS = ("rollout_args", "grpo_args", "optimizer_args", "lora_args", "perf_args")
JOB_BUILDERS = ("U.colocated_job", "U.TrainJob")
DOCSTRING_SECTIONS = ("What it trains:", "Prerequisites:", "layout", "Example:")


def test_every_catalog_recipe_exists():
    """A renamed or removed catalog recipe must be renamed here too, or its house-style checks vanish."""
    missing = [p.name for p in RECIPES if not p.is_file()]
    assert not missing, f"CATALOG names recipes that are not in scripts/: {missing}"


def _ids(paths):
    return [p.stem for p in paths]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _top_level(tree: ast.Module, kind: type) -> dict[str, ast.AST]:
    return {node.name: node for node in tree.body if isinstance(node, kind)}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scales_of(module) -> tuple[str | None, ...]:
    hints = typing.get_type_hints(module.ScriptArgs)
    return typing.get_args(hints["scale"]) if "scale" in hints else (None,)


def test_there_are_recipes():
    assert len(RECIPES) >= 9, [p.name for p in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_docstring_names_purpose_prerequisites_layout_and_example(path):
    doc = ast.get_docstring(_tree(path))
    assert doc, f"{path.name}: no module docstring"
    for section in DOCSTRING_SECTIONS:
        assert section in doc, f"{path.name}: docstring lacks {section!r}"
    assert f"python3 scripts/{path.name}" in doc, f"{path.name}: docstring has no runnable example"


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_script_args_prepare_execute_main(path):
    tree = _tree(path)
    classes, functions = _top_level(tree, ast.ClassDef), _top_level(tree, ast.FunctionDef)
    assert "ScriptArgs" in classes, f"{path.name}: no ScriptArgs"
    bases = [ast.unparse(b) for b in classes["ScriptArgs"].bases]
    scaled = "_SCALES" in {t.id for node in tree.body if isinstance(node, ast.AnnAssign | ast.Assign)
                           for t in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
                           if isinstance(t, ast.Name)}
    expected = ["U.ScaledRecipeArgs"] if scaled else ["U.ExecuteTrainConfig"]
    assert bases == expected, f"{path.name}: ScriptArgs bases {bases}"
    for name in ("prepare", "execute", "main"):
        assert name in functions, f"{path.name}: no {name}()"
    decorators = [ast.unparse(d) for d in functions["main"].decorator_list]
    assert decorators == ["U.dataclass_cli"], f"{path.name}: main() decorated with {decorators}"
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert "import miles.launcher.recipe_api as U" in imports


def test_the_layout_check_knows_the_launchers_blocks():
    from miles.launcher import train_job

    assert train_job.FLAG_BLOCKS == FLAG_BLOCKS and train_job.RECIPE_BLOCKS == RECIPE_BLOCKS


def _assigned_names(function: ast.FunctionDef) -> list[str]:
    return [t.id for node in ast.walk(function) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)]


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_execute_names_its_own_blocks_and_takes_the_shared_ones_from_one_job(path):
    execute = _top_level(_tree(path), ast.FunctionDef)["execute"]
    calls = [n for n in ast.walk(execute) if isinstance(n, ast.Call)]
    builders = [ast.unparse(c.func) for c in calls if ast.unparse(c.func) in JOB_BUILDERS]
    assert len(builders) == 1, f"{path.name}: execute() builds {builders or 'no job'}; one of {JOB_BUILDERS}"
    blocks = [name for name in _assigned_names(execute) if name in FLAG_BLOCKS]
    assert blocks == [name for name in FLAG_BLOCKS if name in blocks], f"{path.name}: blocks out of order {blocks}"
    assert set(RECIPE_BLOCKS) <= set(blocks), f"{path.name}: names {blocks}, lacks {set(RECIPE_BLOCKS) - set(blocks)}"

    last = execute.body[-1]
    assert isinstance(last, ast.Expr) and isinstance(last.value, ast.Call), f"{path.name}: execute() ends otherwise"
    launch = last.value
    assert ast.unparse(launch.func).endswith(".execute_train") and not launch.args, ast.unparse(launch)
    handed = {kw.arg: ast.unparse(kw.value) for kw in launch.keywords}
    assert handed == {name: name for name in blocks}, f"{path.name}: execute_train gets {handed}, names {blocks}"
    direct = {ast.unparse(c.func) for c in calls} & {"U.execute_train", "U.get_default_wandb_args"}
    assert not direct, f"{path.name}: calls {direct} itself; the job joins the blocks and launches"


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_every_option_has_help(path):
    module = _load(path)
    for f in dataclasses.fields(module.ScriptArgs):
        assert f.metadata.get("help"), f"{path.name}: --{f.name.replace('_', '-')} has no help"
    hints = typing.get_type_hints(module.ScriptArgs)
    if "scale" in hints:
        scales = typing.get_args(hints["scale"])
        assert set(SCALES) <= set(scales) <= set(SCALES + EXTRA_SCALES), scales


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, train_args, num_gpus_per_node, config, **kwargs):
        self.calls.append({"train_args": train_args, "num_gpus_per_node": num_gpus_per_node,
                           "config": config, **kwargs})


def _cases():
    cases = []
    for path in RECIPES:
        for scale in _scales_of(_load(path)):
            cases.append(pytest.param(path, scale, id=f"{path.stem}-{scale or 'default'}"))
    return cases


@pytest.mark.parametrize("path,scale", _cases())
def test_every_scale_assembles_flags_that_validate(path, scale, tmp_path, monkeypatch):
    from miles.flags.arguments import validate_argv

    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    from miles.launcher import train_job

    module = _load(path)
    recorder = _Recorder()
    monkeypatch.setattr(train_job, "execute_train", recorder)
    kwargs = {"output_dir": str(tmp_path), "model_dir": str(tmp_path / "models"), "data_dir": str(tmp_path / "data")}
    if scale is not None:
        kwargs["scale"] = scale
    args = module.ScriptArgs(**kwargs)
    module.execute(args, module.prepare(args))

    assert len(recorder.calls) == 1
    call = recorder.calls[0]
    argv = shlex.split(call["train_args"])
    plan = validate_argv(["--run-dir", str(tmp_path / "run"), *argv])
    assert plan.samples_per_rollout >= plan.dp_size
    device = argv[len(argv) - 1 - argv[::-1].index("--device") + 1]
    if device == "cpu":
        assert call["num_gpus_per_node"] == 0, "a CPU recipe starts its Ray head with no GPUs"
    else:
        assert call["num_gpus_per_node"] > 0
    for flag in call.get("locked_flags") or ():
        assert flag in argv, f"locked flag {flag} is not set by the recipe"
    assert not list(tmp_path.glob("models/*")) and not list(tmp_path.glob("data/*")), "a dry run made assets"


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_dry_run_imports_neither_torch_nor_ray(path, tmp_path):
    # a GPU budget every recipe fits: this test is about imports; the memory plan's refusals are
    # tested in tests/e2e/test_dry.py (a CPU recipe has no GPU budget to give)
    budget = [] if path.stem.endswith("_cpu") else ["--extra-args", "--gpu-memory-gb 100000"]
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{str(path)!r}, '--output-dir', {str(tmp_path)!r}, *{budget!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(path)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'diffusers', 'transformers') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    env = dict(os.environ, MILES_SCRIPT_ENABLE_RAY_SUBMIT="0")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HEAVY=\n" in result.stdout, result.stdout[-500:]
    plans = list(tmp_path.glob("*/plan.json"))
    assert len(plans) == 1
    assert json.loads(plans[0].read_text())["dry_run"] is True
    assert "EXEC: " in result.stdout
