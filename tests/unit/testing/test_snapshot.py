import socket

from miles.testing.snapshot import Normalizer, group_flags, render_plan

PLAN = {
    "version": 1, "recipe": "scripts/run_x.py", "run_id": "20261129-081957-193110",
    "run_dir": "/tmp/pytest-7/dry0/20261129-081957-193110", "train_script": "train_diffusion.py",
    "argv": ["--run-dir", "/tmp/pytest-7/dry0/20261129-081957-193110", "--lr", "1e-4",
             "--colocate", "--update-weight-target-module", "transformer", "transformer_2"],
    "locked_flags": {"--lr": "1e-4"},
    "runtime_env": {"env_vars": {"WANDB_API_KEY": "<redacted>", "PYTHONPATH": "/repo", "HF_TOKEN": "hf_abcdef123"}},
    "num_nodes": 1, "num_gpus_per_node": 4, "cuda_visible_devices": None, "external_ray": False,
    "dry_run": True, "ray": {"gcs_port": 43211, "temp_dir": "/tmp/mray-0123456789ab"},
    "commands": ["ray start --head --port=43211 --temp-dir=/tmp/mray-0123456789ab",
                 "ray job submit --address=http://127.0.0.1:8265 -- python3 /repo/train_diffusion.py "
                 "--run-dir /tmp/pytest-7/dry0/20261129-081957-193110 --lr 1e-4 --colocate "
                 "--update-weight-target-module transformer transformer_2"],
}


def norm():
    return Normalizer({"/tmp/pytest-7/dry0/20261129-081957-193110": "<RUN_DIR>", "/tmp/pytest-7/dry0": "<OUTPUT_DIR>",
                       "20261129-081957-193110": "<RUN_ID>", "/repo": "<REPO>", "/tmp/mray-0123456789ab": "<RAY_TEMP_DIR>"})


def test_group_flags_puts_each_flag_with_its_values():
    assert group_flags(["--a", "1", "--b", "--c", "x", "y"]) == [["--a", "1"], ["--b"], ["--c", "x", "y"]]


def test_plan_text_has_one_flag_per_line():
    text = render_plan(PLAN, norm())
    argv = text.split("[argv]\n")[1].split("\n\n")[0].splitlines()
    assert argv == ["--run-dir <RUN_DIR>", "--lr 1e-4", "--colocate",
                    "--update-weight-target-module transformer transformer_2"]


def test_paths_run_ids_ports_and_secrets_are_normalised():
    text = render_plan(PLAN, norm())
    for raw in ("/tmp/pytest-7", "20261129-081957-193110", "43211", "8265", "hf_abcdef123", "mray-0123"):
        assert raw not in text
    assert "HF_TOKEN=<redacted>" in text and "WANDB_API_KEY=<redacted>" in text


def test_same_plan_from_another_run_renders_identically():
    other = dict(PLAN)
    other_dir = "/tmp/pytest-9/dry3/20261130-000000-aaaaaa"
    other.update(run_id="20261130-000000-aaaaaa", run_dir=other_dir,
                 argv=[other_dir if a == PLAN["run_dir"] else a for a in PLAN["argv"]],
                 commands=[c.replace(PLAN["run_dir"], other_dir).replace("43211", "50001").replace("0123456789ab", "ffffffffffff")
                               for c in PLAN["commands"]],
                 ray={"gcs_port": 50001, "temp_dir": "/tmp/mray-ffffffffffff"})
    n2 = Normalizer({other_dir: "<RUN_DIR>", "/tmp/pytest-9/dry3": "<OUTPUT_DIR>", "20261130-000000-aaaaaa": "<RUN_ID>",
                     "/repo": "<REPO>", "/tmp/mray-ffffffffffff": "<RAY_TEMP_DIR>"})
    assert render_plan(other, n2) == render_plan(PLAN, norm())


def test_commands_elide_the_train_argv_shown_above():
    text = render_plan(PLAN, norm())
    commands = text.split("[commands]\n")[1]
    assert "<argv>" in commands and "--update-weight-target-module" not in commands


def test_host_name_is_replaced_only_as_a_whole_word():
    host = socket.gethostname()
    n = Normalizer({})
    assert n.text(f"--master {host} --x") == "--master <HOST> --x"
    assert n.text(f"/data/{host}x/file") == f"/data/{host}x/file"


def test_a_secret_value_from_the_environment_never_survives(monkeypatch):
    n = Normalizer({}, secrets=["s3cr3t-value-123"])
    assert "s3cr3t" not in n.text("--extra X=s3cr3t-value-123")
