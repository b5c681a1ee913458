"""Issue 11: the launcher talks only to the cluster it means, fails closed, validates the train argv
before anything starts, refuses escaping run ids, and keeps secrets out of everything it shows or
writes. All of this runs without Ray (dry runs, or a real launch refused before Ray starts)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.testing.snapshot import Normalizer, render_plan
from miles.launcher.env_vars import (
    REDACTED,
    is_secret_name,
    parse_secret_env,
    redact_env,
    redact_text,
    register_secret_names,
)
from miles.launcher.launch_mode import LaunchModeError, check_job_server_url, dry_run_switch
from miles.launcher.ray_cluster import free_ports

RECIPE = Path(__file__).with_name("example_recipe.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


def _launch(out, *argv, dry=True, run_id="run1", **env):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("MILES_SCRIPT_", "WANDB_")) and k not in ("RAY_ADDRESS", "ENABLE_RAY_SUBMIT")}
    if dry:
        environ["MILES_SCRIPT_ENABLE_RAY_SUBMIT"] = "0"
    environ.update(env)
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(RECIPE), "train", "--output-dir", str(out), "--run-id", run_id,
                             *argv], capture_output=True, text=True, env=environ, timeout=60,
                            start_new_session=True)
    result.seconds = time.monotonic() - started
    return result


def _plan(out, run_id="run1"):
    return json.loads((out / run_id / "plan.json").read_text())


def _last_line(result):
    return result.stderr.strip().splitlines()[-1]


# -- 1: the one cluster it means ---------------------------------------------------------------

def test_an_inherited_ray_address_never_redirects_the_job(out):
    result = _launch(out, RAY_ADDRESS="http://127.0.0.1:2")
    assert result.returncode == 0, result.stderr
    plan = _plan(out)
    assert "127.0.0.1:2" not in plan["ray"]["job_server"] and plan["ray"]["address_from"] == "own head"
    assert not any("127.0.0.1:2 " in c or "127.0.0.1:2'" in c for c in plan["commands"])
    assert "ignoring RAY_ADDRESS" in result.stderr


@pytest.mark.parametrize("value", ["127.0.0.1:9", "ray://127.0.0.1:10001", "http://127.0.0.1"])
def test_external_address_without_a_job_server_url_exits_2_naming_the_variable(out, value):
    result = _launch(out, MILES_SCRIPT_EXTERNAL_RAY="1", RAY_ADDRESS=value)
    assert result.returncode == 2 and "RAY_ADDRESS" in _last_line(result) and "fix:" in _last_line(result)
    assert not (out / "run1").exists()


def test_unreachable_external_cluster_is_one_line_within_seconds(out):
    port = free_ports(1)[0]
    # a train script of its own: the example's text-file assets would be refused by the preflight first
    never_runs = out.parent / "never_runs.py"
    never_runs.write_text("raise SystemExit('submitted to a cluster that cannot be reached')\n")
    result = _launch(out, "--train-script", str(never_runs), dry=False, MILES_SCRIPT_ENABLE_RAY_SUBMIT="1",
                     MILES_SCRIPT_EXTERNAL_RAY="1", MILES_SCRIPT_RAY_ADDRESS=f"http://127.0.0.1:{port}",
                     RAY_ADDRESS="http://127.0.0.1:2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert f"127.0.0.1:{port}" in _last_line(result) and "MILES_SCRIPT_RAY_ADDRESS" in _last_line(result)
    assert result.seconds < 20
    assert _plan(out)["ray"] == {"job_server": f"http://127.0.0.1:{port}", "address_from": "MILES_SCRIPT_RAY_ADDRESS",
                                 "auth": "the mode the cluster reports"}


def test_job_server_url_check():
    assert check_job_server_url("X", "http://10.0.0.1:8265/") == "http://10.0.0.1:8265"
    with pytest.raises(LaunchModeError, match="GCS address"):
        check_job_server_url("X", "10.0.0.1:6379")


# -- 2: the dry-run switch fails closed --------------------------------------------------------

@pytest.mark.parametrize("name", ["MILES_SCRIPT_ENABLE_RAY_SUBMIT", "ENABLE_RAY_SUBMIT"])
def test_an_unknown_switch_value_exits_2_naming_variable_and_values(out, name):
    result = _launch(out, dry=False, **{name: "fasle"})
    assert result.returncode == 2
    assert name in _last_line(result) and "0/false/no/off" in _last_line(result)
    assert "EXEC:" not in result.stdout


def test_bare_enable_ray_submit_is_an_alias_and_the_plan_says_which_variable_decided(out):
    result = _launch(out, dry=False, ENABLE_RAY_SUBMIT="0")
    assert result.returncode == 0, result.stderr
    assert _plan(out)["dry_run"] is True and _plan(out)["dry_run_decided_by"] == "ENABLE_RAY_SUBMIT"


def test_switch_values():
    assert dry_run_switch({}) == (False, "default")
    assert dry_run_switch({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "False"}) == (True, "MILES_SCRIPT_ENABLE_RAY_SUBMIT")
    assert dry_run_switch({"ENABLE_RAY_SUBMIT": "yes"}) == (False, "ENABLE_RAY_SUBMIT")
    with pytest.raises(LaunchModeError, match="disagree"):
        dry_run_switch({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "ENABLE_RAY_SUBMIT": "1"})


# -- 3: the assembled argv is validated before anything starts ---------------------------------

@pytest.mark.parametrize("argv, env, expected", [
    (["--extra-args", "--colocat"], {}, "did you mean --colocate?"),
    (["--extra-args", "--diffusion-kl-beta 0.02"], {}, "needs a reference policy"),  # a rule between flags
    ([], {"MILES_SCRIPT_NUM_ROLLOUT": "-3"}, "--num-rollout: must be >= 1"),
    (["--extra-args", "--micro-batch-size 0"], {}, "--micro-batch-size"),
])
@pytest.mark.parametrize("dry", [True, False])
def test_a_bad_train_argv_fails_in_under_a_second_before_anything_starts(out, argv, env, expected, dry):
    result = _launch(out, *argv, dry=dry, **({} if dry else {"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "1"}), **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in _last_line(result)
    assert "EXEC:" not in result.stdout and not (out / "run1").exists() and not (out / ".launcher").exists()
    assert result.seconds < 5  # in-process parse: well under a second of its own


def test_a_device_list_shorter_than_the_recipe_needs_is_refused(out):
    result = _launch(out, "--num-gpus-per-node", "2", "--cuda-visible-devices", "0")
    assert result.returncode == 2 and "lists 1 GPU(s) but this recipe needs 2" in _last_line(result)


# -- 5: a run id is one path component ---------------------------------------------------------

@pytest.mark.parametrize("run_id", ["../../escaped", "a/b", "..", ".hidden", "/abs", ""])
def test_a_run_id_that_is_not_one_path_component_exits_2(tmp_path, out, run_id):
    result = _launch(out, run_id=run_id)
    assert result.returncode == 2 and "--run-id" in _last_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and list(out.iterdir()) == []


# -- 6: one secret rule ------------------------------------------------------------------------

SECRET_NAMES = [
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "SECRET_KEY", "PRIVATE_KEY", "GITHUB_PAT", "GITHUB_TOKEN",
    "HF_TOKEN", "HF_TOKEN_READ", "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "DB_PASSWORD",
    "PGPASSWORD", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_CLIENT_SECRET", "SLACK_BOT_TOKEN2", "NPM_AUTH_TOKEN",
    "DOCKER_AUTH", "SSH_PRIVATE", "MY_APIKEY",
]


def _secret(name):
    return f"s3cr3t-{name.lower().replace('_', '-')}-Xy9"


def test_the_rule_matches_whole_parts_only():
    assert all(is_secret_name(n) for n in SECRET_NAMES)
    for name in ("PATH", "KEYFRAMES", "TOKENIZER_DIR", "PATCH_SIZE", "PWD", "MASTER_ADDR", "NCCL_SOCKET_IFNAME"):
        assert not is_secret_name(name), name


def test_secret_env_adds_names_and_values_are_redacted_as_substrings():
    assert parse_secret_env("DB_URL, MY_CERT") == ["DB_URL", "MY_CERT"]
    register_secret_names(["MILES_TEST_ONLY_DSN"])
    assert is_secret_name("MILES_TEST_ONLY_DSN")
    env = {"HF_TOKEN": "hf_AbCdEf123456", "URL": "https://x:hf_AbCdEf123456@host/p"}
    assert redact_env(env) == {"HF_TOKEN": REDACTED, "URL": f"https://x:{REDACTED}@host/p"}
    assert redact_text("key hf_AbCdEf123456 here", ["hf_AbCdEf123456"]) == f"key {REDACTED} here"


def test_twenty_secret_names_through_extra_env_vars_appear_nowhere(tmp_path, out):
    extra = " ".join(f"{n}={_secret(n)}" for n in SECRET_NAMES) + " CUSTOM_DSN=postgres://u:pw-Zz81@db/x"
    result = _launch(out, "--extra-env-vars", extra, "--secret-env", "CUSTOM_DSN",
                     "--extra-args", f"--wandb-run-name {_secret('HF_TOKEN')}", HF_TOKEN=_secret("HF_TOKEN"))
    assert result.returncode == 0, result.stderr
    values = [_secret(n) for n in SECRET_NAMES] + ["postgres://u:pw-Zz81@db/x"]
    plan_text = (out / "run1" / "plan.json").read_text()
    snapshot = render_plan(json.loads(plan_text), Normalizer({str(out): "<OUT>"}))
    files = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    for value in values:
        for where, text in (("stdout", result.stdout), ("stderr", result.stderr), ("plan", plan_text),
                            ("snapshot", snapshot), ("output dir", files)):
            assert value not in text, f"{value} leaked into {where}"
    assert plan_text.count(REDACTED) >= len(values)



def test_snapshots_hide_exactly_what_the_launcher_hides():
    """One rule: the snapshot normaliser asks the launcher's is_secret_name and redacts values with
    its redact_text, so a name the launcher shows (KEYFRAMES) is shown in a snapshot too."""
    from miles.testing.snapshot import secret_values_from_env

    norm = Normalizer({}, secrets=[_secret(n) for n in SECRET_NAMES])
    shown = ("PATH", "KEYFRAMES", "TOKENIZER_DIR", "PATCH_SIZE", "MASTER_ADDR", "MONKEY_BUSINESS")
    for name in (*SECRET_NAMES, *shown):
        value = _secret(name)
        assert (norm.env_value(name, value) == REDACTED) == is_secret_name(name), name
        assert (norm.text(f"{name}=plain-value-123") == f"{name}={REDACTED}") == is_secret_name(name), name
        assert norm.env_value(name, value) == redact_env({name: value})[name]
    assert _secret("HF_TOKEN") not in norm.text(f"--wandb-run-name {_secret('HF_TOKEN')} --x 1")
    env = {"HF_TOKEN": "hf_AbCdEf123456", "KEYFRAMES": "kf-not-secret-99", "RAY_AUTH_MODE": "disabled"}
    assert secret_values_from_env(env) == ["hf_AbCdEf123456"]


# -- 8: one line instead of a traceback --------------------------------------------------------

def test_an_unwritable_output_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = _launch(blocker / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--output-dir" in _last_line(result)


def test_negative_lr_is_a_value_refused_for_its_sign():
    from miles.flags.arguments import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--hf-checkpoint", "x", "--lr", "-1e-4"])
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), "--hf-checkpoint", "x", "--lr", "-1e-4",
                             "--validate-only"], capture_output=True, text=True, timeout=60)
    assert "--lr: must be > 0, got '-1e-4'" in result.stderr and "expected one argument" not in result.stderr


@pytest.mark.parametrize("module", ["miles.rollout.sample", "miles.rollout.rm_hub.score"])
def test_help_of_small_clis_imports_no_torch(module):
    code = (f"import sys, runpy; sys.argv = ['x', '--help']\n"
            f"try:\n    runpy.run_module('{module}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            f"print('TORCH', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "TORCH False" in result.stdout, result.stdout + result.stderr


def test_sample_on_a_corrupt_checkpoint_is_one_line(tmp_path):
    (tmp_path / "model_index.json").write_text("{not json")
    (tmp_path / "config.json").write_text("{not json")
    result = subprocess.run([sys.executable, "-m", "miles.rollout.sample", "--hf-checkpoint", str(tmp_path),
                             "--prompt", "p", "--out", str(tmp_path / "g.png")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "fix:" in result.stderr


def test_a_failing_train_is_one_line_and_the_traceback_goes_to_the_run_dir(tmp_path, capsys):
    import argparse

    sys.path.insert(0, str(REPO))
    try:
        import train_diffusion
    finally:
        sys.path.remove(str(REPO))
    try:
        raise ValueError("data/p.jsonl line 3 is not valid JSON: Expecting value\nmore detail")
    except ValueError as err:
        status = train_diffusion.report_failure(argparse.Namespace(run_dir=str(tmp_path)), err)
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err_lines) == 1
    assert "ValueError: data/p.jsonl line 3 is not valid JSON" in err_lines[0] and "traceback.txt" in err_lines[0]
    assert "Traceback" in (tmp_path / "traceback.txt").read_text()


# -- 9: Ray's banner goes to a log file --------------------------------------------------------

def test_exec_command_with_a_log_path_keeps_the_output_out_of_the_terminal(tmp_path, capfd):
    from miles.launcher.processes import exec_command

    exec_command("echo 'To terminate the Ray runtime, run ray stop'", dry_run=False, log_path=tmp_path / "l.log")
    shown = capfd.readouterr().out
    assert shown.startswith("EXEC: ") and "To terminate" not in shown.split("\n", 1)[1]
    assert "To terminate" in (tmp_path / "l.log").read_text()
