"""The example recipe run as users run it, with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).with_name("example_recipe.py")
SECRET = "wandb-secret-value-9f8e7d"
PLAN_KEYS = ["version", "recipe", "run_id", "run_dir", "train_script", "argv", "locked_flags", "runtime_env",
             "num_nodes", "num_gpus_per_node", "cuda_visible_devices", "external_ray", "dry_run", "ray", "commands",
             "prepare_commands", "hub_revisions", "memory_plan", "memory_plan_error", "dry_run_decided_by"]


@pytest.fixture
def sandbox(tmp_path):
    """Output dir plus a cwd, HOME and TMPDIR of the run's own, to see where it writes."""
    dirs = {name: tmp_path / name for name in ("out", "cwd", "home", "tmp")}
    for path in dirs.values():
        path.mkdir()
    return dirs


def _dry(sandbox, *argv, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_") and k != "WANDB_API_KEY"}
    environ.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "HOME": str(sandbox["home"]), "TMPDIR": str(sandbox["tmp"]),
                    **env})
    argv = ["train", "--output-dir", str(sandbox["out"]), "--run-id", "run1", *argv]
    # a session of its own: whatever the run starts stays in it (Ray's daemons do not setsid)
    proc = subprocess.Popen([sys.executable, str(RECIPE), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environ, cwd=sandbox["cwd"], start_new_session=True)
    stdout, stderr = proc.communicate(timeout=60)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    result.session_id = proc.pid
    return result


def _plan(sandbox):
    return json.loads((sandbox["out"] / "run1" / "plan.json").read_text())


def _value_after(argv, flag):
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, "3"),
    ([], {"MILES_SCRIPT_NUM_ROLLOUT": "7"}, "7"),
    (["--num-rollout", "9"], {"MILES_SCRIPT_NUM_ROLLOUT": "7"}, "9"),
])
def test_plan_shows_command_line_over_environment_over_default(sandbox, argv, env, expected):
    result = _dry(sandbox, *argv, **env)
    assert result.returncode == 0, result.stderr
    assert _value_after(_plan(sandbox)["argv"], "--num-rollout") == [expected]


def test_plan_has_the_documented_format_and_options_table_prints_first(sandbox):
    result = _dry(sandbox)
    plan = _plan(sandbox)
    assert list(plan) == PLAN_KEYS
    assert plan["dry_run"] is True and plan["external_ray"] is False and plan["version"] == 1
    assert plan["argv"][:2] == ["--run-dir", str(sandbox["out"] / "run1")] and plan["run_id"] == "run1"
    assert plan["recipe"].endswith("example_recipe.py") and plan["locked_flags"] == {"--diffusion-num-steps": "8"}
    assert plan["num_gpus_per_node"] == 0 and plan["ray"]["gcs_port"] == 0
    assert " start --head " in plan["commands"][0] and "--num-gpus=0" in plan["commands"][0]
    assert "ray_start.py" in plan["commands"][0] and "client-server" not in plan["commands"][0]
    # the head requires a token of its own; the plan names its file, never a token
    assert plan["ray"]["auth"] == {"mode": "token", "token_file": str(sandbox["out"] / "run1" / "ray_auth_token")}
    assert plan["ray"]["dashboard_host"] == "127.0.0.1" and plan["ray"]["open_to_network"]
    assert plan["commands"][-1].startswith("ray job submit")
    assert result.stdout.index("--num-rollout") < result.stdout.index("EXEC: ")
    assert [line for line in result.stdout.splitlines() if line.startswith("EXEC: ")] == \
        [f"EXEC: {c}" for c in plan["commands"]]


def test_extra_args_land_after_the_recipes_flags(sandbox):
    assert _dry(sandbox, "--extra-args", "--lr 5e-4").returncode == 0
    argv = _plan(sandbox)["argv"]
    assert argv[-2:] == ["--lr", "5e-4"]
    assert argv.index("--lr") < len(argv) - 2  # the recipe's own value comes first


def test_wandb_key_adds_flags_but_appears_nowhere(sandbox):
    result = _dry(sandbox, WANDB_API_KEY=SECRET)
    plan = _plan(sandbox)
    assert "--use-wandb" in plan["argv"] and plan["runtime_env"]["env_vars"]["WANDB_API_KEY"] == "<redacted>"
    assert SECRET not in result.stdout + result.stderr
    for path in sandbox["out"].rglob("*"):
        assert not path.is_file() or SECRET not in path.read_text(), path


def test_without_wandb_key_no_wandb_flags(sandbox):
    _dry(sandbox)
    assert not any(word.startswith("--wandb") or word == "--use-wandb" for word in _plan(sandbox)["argv"])


def test_dry_run_starts_no_process_and_writes_only_under_the_output_dir(sandbox):
    result = _dry(sandbox)
    assert result.returncode == 0, result.stderr
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _sid(int(p)) == result.session_id]
    assert leftovers == []
    assert not Path(_plan(sandbox)["ray"]["temp_dir"]).exists()
    for name in ("cwd", "home", "tmp"):
        assert list(sandbox[name].iterdir()) == [], name
    assert {p.name for p in sandbox["out"].rglob("*")} == {"run1", "plan.json"}


def _sid(pid):
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_dry_run_imports_neither_torch_nor_ray(sandbox):
    result = _dry(sandbox, PYTHONPROFILEIMPORTTIME="1")
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "ray")}
    assert "typer" in imported


def test_dry_run_costs_well_under_a_second_of_cpu(sandbox):
    # CPU time rather than wall time: the machine is shared, and a busy neighbour stretches wall
    # time without our doing. Idle, the whole dry run takes about 0.3 s of wall time; importing
    # torch alone would cost more than this bound.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert _dry(sandbox).returncode == 0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 1.0


def test_external_ray_with_cuda_visible_devices_is_refused_before_anything_starts(sandbox):
    result = _dry(sandbox, "--cuda-visible-devices", "0,1", MILES_SCRIPT_EXTERNAL_RAY="1",
                  MILES_SCRIPT_ENABLE_RAY_SUBMIT="1")
    assert result.returncode != 0
    assert "MILES_SCRIPT_EXTERNAL_RAY=1" in result.stderr and "--cuda-visible-devices" in result.stderr
    assert "EXEC:" not in result.stdout
    assert list(sandbox["out"].iterdir()) == []


def test_external_ray_submits_to_ray_address_without_starting_a_head(sandbox):
    result = _dry(sandbox, MILES_SCRIPT_EXTERNAL_RAY="1", RAY_ADDRESS="http://10.1.2.3:8265")
    plan = _plan(sandbox)
    assert result.returncode == 0 and plan["external_ray"] is True
    assert plan["commands"] == [c for c in plan["commands"] if c.startswith("ray job submit --address=http://10.1.2.3:8265")]


def test_overriding_a_locked_flag_exits_2_before_anything_starts(sandbox):
    result = _dry(sandbox, "--extra-args", "--diffusion-num-steps 4")
    assert result.returncode == 2
    assert "--diffusion-num-steps" in result.stderr and "'8'" in result.stderr and "edit the recipe" in result.stderr
    assert list(sandbox["out"].iterdir()) == []


def test_malformed_extra_env_vars_exit_2_naming_the_option(sandbox):
    result = _dry(sandbox, "--extra-env-vars", "NOT_AN_ASSIGNMENT")
    assert result.returncode == 2 and "--extra-env-vars" in result.stderr


def test_model_name_selects_a_recipe_row(sandbox):
    _dry(sandbox, "--model-name", "tiny-b")
    assert _value_after(_plan(sandbox)["argv"], "--diffusion-num-steps") == ["4"]


def test_help_lists_every_option_with_its_help(sandbox):
    result = subprocess.run([sys.executable, str(RECIPE), "train", "--help"], capture_output=True, text=True)
    for text in ("--num-nodes", "--cuda-visible-devices", "--output-dir", "--extra-env-vars", "--extra-args",
                 "--run-id", "--model-name", "tiny-a|tiny-b", "Rollouts to train.", "MILES_SCRIPT_NUM_ROLLOUT"):
        assert text in result.stdout, text


def test_worker_dry_run_prints_the_join_command_and_records_nothing(sandbox):
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
               "MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0"}
    result = subprocess.run(
        [sys.executable, str(RECIPE), "worker", "--head-address", "127.0.0.1:6399",
         "--output-dir", str(sandbox["out"])],
        capture_output=True, text=True, env=environ, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ray_start.py start --address=127.0.0.1:6399 --node-ip-address=127.0.0.1" in result.stdout
    # ... and says that a real worker, given no token of the head's, would refuse
    assert "note: a real worker would refuse: the head requires its token" in result.stderr
    assert list(sandbox["out"].iterdir()) == []


def test_secret_extra_env_vars_are_redacted_in_the_table_commands_and_plan(sandbox):
    result = _dry(sandbox, "--extra-env-vars", f"HF_TOKEN={SECRET} FOO=bar")
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr + (sandbox["out"] / "run1" / "plan.json").read_text()
    assert _plan(sandbox)["runtime_env"]["env_vars"]["FOO"] == "bar"


def test_dry_run_names_the_hook_without_calling_it(sandbox):
    result = _dry(sandbox)
    assert "would call _announce" in result.stdout and "before submit:" not in result.stdout
