"""A launch of miles-diffusion's kind, in process and dry: its train script checked (mapped, refused
or missing), its flags by one rule in the plan, gated checkpoints named with their licence page."""

from __future__ import annotations

import json

import pytest

import miles.utils.external_utils.command_utils as U

ARGV = ("--hf-checkpoint stabilityai/stable-diffusion-3.5-medium --diffusion-model-family sd3 --rm-type brightness "
        "--prompt-data p --num-rollout 1 --device cpu --colocate --num-gpus-per-node 1")
SFT = ("--hf-checkpoint ckpt --diffusion-model-family sd3 --prompt-data p --num-epoch 1 --device cpu "
       "--num-gpus-per-node 1 --loss-type sft_loss --n-samples-per-prompt 1 "
       "--rollout-function-path miles.rollout.sft_rollout.generate_rollout")


@pytest.fixture
def launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def run(train_args: str, run_id: str, **options):
        config = U.ExecuteTrainConfig(output_dir=str(tmp_path / "out"), run_id=run_id)
        capsys.readouterr()
        try:
            U.execute_train(train_args, 0, config, **options)
        except SystemExit as stopped:
            err = capsys.readouterr().err.strip().splitlines()
            assert stopped.code == 2 and len(err) == 1, err
            return err[0]
        return json.loads((tmp_path / "out" / run_id / "plan.json").read_text())
    return run


def test_train_sft_py_runs_train_diffusion_py_with_its_flags_checked(launch):
    plan = launch(SFT, "sft", train_script="train_sft.py")
    assert plan["train_script"] == "train_diffusion.py" and plan["commands"][-1].split(" -- ")[1].split()[1].endswith(
        "/train_diffusion.py")
    assert plan["upstream_flags"]["train_script"].startswith("train_sft.py -> train_diffusion.py")
    assert "--train-only" not in plan["argv"] and "--rollout-function-path" in plan["argv"]  # its SFT rollout: mapped
    refused = launch(SFT + " --no-such-flag", "sft-bad", train_script="train_sft.py")
    assert refused.startswith("error: train_diffusion.py: error: unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("script, message", [
    ("train_diffusion_async.py", "one-step-off-policy (async) trainer does not run here"),
    ("no_such_trainer.py", "no such file"),
])
def test_a_train_script_that_does_not_run_here_is_one_line(launch, script, message):
    line = launch(ARGV, "x", train_script=script)
    assert f"train_script={script}" in line and message in line and "fix:" in line


def test_the_plan_lists_mapped_and_no_counterpart_flags_and_the_job_runs_without_the_latter(launch):
    plan = launch(ARGV + " --use-miles-router --sglang-server-concurrency 8 --fsdp-master-dtype fp32 "
                         "--diffusion-train-iter-order sample_major", "vocab")
    assert "--use-miles-router" not in plan["argv"] and "--sglang-server-concurrency" not in plan["argv"]
    assert "--use-miles-router" not in plan["commands"][-1]
    assert [line.split(":")[0] for line in plan["upstream_flags"]["no_counterpart"]] == [
        "--use-miles-router", "--sglang-server-concurrency 8"]
    assert [line.split(" -> ")[0] for line in plan["upstream_flags"]["mapped"]] == [
        "--fsdp-master-dtype fp32", "--diffusion-train-iter-order sample_major"]
    assert launch(ARGV + " --sglang-tp-size 2", "tp").startswith("error: --sglang-tp-size 2: an engine here runs on one GPU")
    assert "upstream_flags" not in launch(ARGV, "plain")  # a launch of our own names only


def test_the_plan_names_a_gated_checkpoints_licence_page_and_hf_token(launch, capsys):
    plan = launch(ARGV, "gated")
    assert plan["gated_assets"] == [{"repo": "stabilityai/stable-diffusion-3.5-medium",
                                     "licence": "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium",
                                     "token": "HF_TOKEN"}]
    assert "accept its licence at https://huggingface.co/stabilityai" in capsys.readouterr().out
    assert "gated_assets" not in launch(ARGV.replace("stabilityai/stable-diffusion-3.5-medium", "Qwen/Qwen-Image")
                                        .replace("sd3", "qwen_image"), "open")


def test_a_hub_checkpoint_no_family_runs_is_refused_by_its_id_before_anything_is_fetched(launch):
    line = launch(ARGV.replace("stabilityai/stable-diffusion-3.5-medium", "nvidia/Cosmos3-Nano").replace("sd3", "cosmos3"),
                  "foreign")
    assert line.startswith("error: --hf-checkpoint nvidia/Cosmos3-Nano: a mixture-of-transformers") and "fix:" in line
