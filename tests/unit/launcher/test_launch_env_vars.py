import pytest

from miles.launcher.env_vars import (
    REDACTED,
    ExtraEnvVarsError,
    build_job_env_vars,
    parse_extra_env_vars,
    redact_env,
)


def test_extra_env_vars_parse_from_assignments_with_quotes():
    assert parse_extra_env_vars('A=1 B="two words" C=') == {"A": "1", "B": "two words", "C": ""}


def test_extra_env_vars_parse_from_a_json_object():
    assert parse_extra_env_vars('{"A": "1", "B": 2, "C": true}') == {"A": "1", "B": "2", "C": "1"}


def test_empty_extra_env_vars_is_no_variables():
    assert parse_extra_env_vars("  ") == {}


@pytest.mark.parametrize("text", ["A=1 B", '{"A": 1', '["A=1"]', "1A=x", 'A="unclosed'])
def test_malformed_extra_env_vars_error_names_the_option(text):
    with pytest.raises(ExtraEnvVarsError, match="--extra-env-vars"):
        parse_extra_env_vars(text)


def test_job_env_has_unbuffered_output_repo_on_pythonpath_and_master_addr(tmp_path):
    env = build_job_env_vars(tmp_path, {}, environ={}, device="cpu")
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"] == str(tmp_path)
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_job_env_passes_nccl_and_gloo_variables_through_and_nothing_else(tmp_path):
    environ = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "HOME": "/root", "MASTER_ADDR": "10.0.0.1"}
    env = build_job_env_vars(tmp_path, {}, environ=environ, device="cpu")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert "HOME" not in env


def test_extra_env_vars_override_the_launcher_defaults(tmp_path):
    env = build_job_env_vars(tmp_path, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, environ={}, device="cpu")
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_wandb_key_travels_in_the_job_env_only_when_set(tmp_path):
    assert "WANDB_API_KEY" not in build_job_env_vars(tmp_path, {}, environ={}, device="cpu")
    assert build_job_env_vars(tmp_path, {}, environ={"WANDB_API_KEY": "k"}, device="cpu")["WANDB_API_KEY"] == "k"


def test_redaction_hides_keys_tokens_and_passwords_but_not_ordinary_values():
    shown = redact_env({"WANDB_API_KEY": "k", "HF_TOKEN": "t", "DB_PASSWORD": "p", "MASTER_ADDR": "h"})
    assert shown == {"WANDB_API_KEY": REDACTED, "HF_TOKEN": REDACTED, "DB_PASSWORD": REDACTED, "MASTER_ADDR": "h"}


def test_job_request_keeps_inherited_secrets_out_of_the_runtime_env_but_shows_them_redacted():
    from miles.launcher.job_submit import JobRequest

    job = JobRequest("http://127.0.0.1:1", "python3 t.py", {"WANDB_API_KEY": "s3cr3t-value", "A": "1"}, "id",
                     inherited=frozenset({"WANDB_API_KEY"}))
    assert job.runtime_env == {"env_vars": {"A": "1"}}
    shown = job.display_command()
    assert '"WANDB_API_KEY": "<redacted>"' in shown and "s3cr3t-value" not in shown
