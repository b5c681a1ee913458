"""The train_diffusion.py parser: flags, defaults, precedence, suggestions, the YAML override."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.flags.arguments import ConfigError, build_parser, parse_args

REPO = Path(__file__).resolve().parents[3]
BASE = ["--hf-checkpoint", "/ckpt/sd3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
        "--prompt-data", "prompts.jsonl"]

# docs/architecture.md section 1: every flag with the default the trainer may rely on.
DOCUMENTED_DEFAULTS = {
    "actor_num_nodes": 1, "actor_num_gpus_per_node": 1, "rollout_num_gpus": None,
    "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "colocate": False,
    "sequence_parallel_size": 1, "device": "cuda",
    "rollout_batch_size": 32, "n_samples_per_prompt": 8, "global_batch_size": None,
    "num_steps_per_rollout": None, "micro_batch_size": None, "micro_batch_size_sample": None,
    "micro_batch_size_tstep": None, "diffusion_train_iter_order": "sample-major",
    "train_dp_split_mode": "contiguous", "num_rollout": None, "num_epoch": None,
    "diffusion_num_steps": 10, "diffusion_num_sde_steps": None,
    "diffusion_step_strategy_path": "sde_window", "diffusion_sde_window_max_start": 0,
    "diffusion_noise_level": 0.7, "diffusion_guidance_scale": 4.0, "diffusion_guidance_scale_2": None,
    "diffusion_height": 512, "diffusion_width": 512, "diffusion_output_num_frames": 1,
    "diffusion_sde_type": None, "diffusion_shift": None, "negative_prompt": "",
    "rollout_microgroup_size": None, "rollout_seed": 42, "rollout_shuffle": False,
    "diffusion_model_family": None, "update_weight_target_module": None,
    "weight_sync": "bucketed", "update_weight_buffer_size": None,
    "param_dtype": "float32", "compute_dtype": "float32", "rollout_dtype": "float32",
    "gradient_checkpointing": False,
    "loss_type": "policy_loss", "custom_loss_function_path": None, "advantage_estimator": "grpo",
    "diffusion_clip_range": 1e-4, "diffusion_adv_clip_max": 5.0, "diffusion_kl_beta": None,
    "diffusion_kl_reference": "auto", "globalize_reward_mean": False, "globalize_reward_std": False,
    "nft_beta": 1.0, "use_ema": False, "ema_decay": 0.995, "diffusion_timestep_fraction": 0.99,
    "diffusion_nft_adaptive_weight": True, "ema_rollout_policy": None, "ema_decay_init": 0.0,
    "ema_decay_ramp": 0.001, "ema_decay_max": 0.5, "ema_decay_flat_steps": 0, "train_uncond_branch": False,
    "keep_zero_advantage_samples": False,
    "lr": 1e-4, "min_lr": 0.0, "lr_decay_style": "constant", "lr_warmup_steps": 0,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0,
    "clip_grad": 1.0, "seed": 1234,
    "use_lora": False, "lora_rank": None, "lora_alpha": None, "lora_init_weights": "gaussian", "lora_target_modules": None,
    "rm_type": None, "custom_rm_path": None, "reward_key": None, "rm_num_workers": 1,
    "rm_num_gpus_per_worker": 0.0, "colocate_reward": False, "pickscore_model_path": None,
    "reward_timeout": 300,
    "prompt_data": None, "input_key": "prompt", "metadata_key": "metadata",
    "eval_interval": None, "eval_prompt_data": None, "eval_num_prompts": None,
    "save": None, "save_interval": None, "load": None, "start_rollout_id": None,
    "diffusion_debug_mode": False, "debug_skip_optimizer_step": False, "debug_rollout_only": False,
    "train_only": False, "debug_skip_weight_update_at": None, "deterministic_mode": False,
    "run_dir": None, "use_wandb": False, "wandb_project": None, "wandb_group": None,
    "wandb_run_name": None, "wandb_mode": None, "wandb_required": False, "wandb_dir": None,
    "custom_config_path": None, "validate_only": False,
}


def raw(argv):
    """Parsed but not validated: what argparse alone makes of argv."""
    return build_parser().parse_args(argv)


def test_every_documented_flag_exists_with_its_documented_default():
    ns = raw(["--hf-checkpoint", "x"])
    missing = sorted(set(DOCUMENTED_DEFAULTS) - set(vars(ns)))
    assert not missing
    wrong = {dest: getattr(ns, dest) for dest, default in DOCUMENTED_DEFAULTS.items()
             if getattr(ns, dest) != default}
    assert not wrong


def test_hf_checkpoint_is_required(capsys):
    with pytest.raises(SystemExit) as exit:
        raw([])
    assert exit.value.code == 2
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_later_occurrence_of_a_flag_wins():
    assert raw(BASE + ["--lr", "1e-3", "--lr", "2e-3"]).lr == 2e-3
    assert raw(BASE + ["--lora-target-modules", "a", "b", "--lora-target-modules", "c"]).lora_target_modules == ["c"]


def test_no_form_switches_off_a_boolean_a_recipe_switched_on():
    assert raw(BASE + ["--colocate", "--no-colocate"]).colocate is False
    assert raw(BASE + ["--no-colocate", "--colocate"]).colocate is True


def test_unknown_flag_is_an_argparse_error_that_suggests_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        raw(BASE + ["--colocat"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --colocat (did you mean --colocate?)" in err


def test_unknown_flag_with_inline_value_is_matched_on_its_name(capsys):
    with pytest.raises(SystemExit):
        raw(BASE + ["--diffusion-num-step=4"])
    assert "did you mean --diffusion-num-steps?" in capsys.readouterr().err


def test_unknown_flag_far_from_any_flag_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        raw(BASE + ["--zzzzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzzzz" in err and "did you mean" not in err


def test_flag_prefixes_are_not_accepted_as_abbreviations(capsys):
    with pytest.raises(SystemExit):
        raw(BASE + ["--rollout-batch", "4"])
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [
    ("--rollout-batch-size", "0"), ("--micro-batch-size", "1.5"), ("--lr", "-1"),
    ("--adam-beta1", "1.0"), ("--diffusion-kl-beta", "-0.1"), ("--device", "tpu"),
    ("--loss-type", "dpo"), ("--diffusion-num-steps", "ten"),
])
def test_bad_value_is_an_argparse_error(flag, value, capsys):
    with pytest.raises(SystemExit) as exit:
        raw(BASE + [flag, value])
    assert exit.value.code == 2
    assert flag in capsys.readouterr().err


def test_help_lists_every_group(capsys):
    with pytest.raises(SystemExit) as exit:
        raw(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for group in ("cluster", "batch", "sampling", "model", "algorithm", "optimizer", "lora", "reward",
                  "data", "eval", "checkpoint", "debug", "determinism", "logging", "config"):
        assert f"\n{group}" in out, group


def test_parse_path_imports_neither_torch_nor_ray():
    code = textwrap.dedent(f"""
        import sys
        sys.argv = ["train_diffusion.py", "--validate-only", *{BASE!r}]
        import train_diffusion
        code = train_diffusion.main(sys.argv[1:])
        heavy = sorted(m for m in ("torch", "ray", "diffusers", "transformers") if m in sys.modules)
        print("HEAVY", heavy, "CODE", code)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert "HEAVY [] CODE 0" in out


# ---- --custom-config-path ----

def write_yaml(tmp_path, text) -> str:
    path = tmp_path / "override.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_config_file_overrides_the_command_line_key_by_key(tmp_path):
    path = write_yaml(tmp_path, """
        num_rollout: 7
        --lr: 0.003
        rollout-batch-size: 4
        colocate: true
        lora_target_modules: [to_q, to_k]
        use_lora: true
    """)
    ns = parse_args(BASE + ["--lr", "1e-3", "--custom-config-path", path])
    assert (ns.num_rollout, ns.lr, ns.rollout_batch_size, ns.colocate) == (7, 0.003, 4, True)
    assert ns.lora_target_modules == ["to_q", "to_k"]
    assert ns.n_samples_per_prompt == 8  # keys the file does not name keep their parsed value


def test_config_file_logs_one_warning_per_override(tmp_path, caplog):
    path = write_yaml(tmp_path, "num_rollout: 7\nseed: 3\n")
    with caplog.at_level(logging.WARNING, logger="miles.flags.arguments"):
        parse_args(BASE + ["--custom-config-path", path])
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    assert any("num_rollout=7 (was 2)" in m for m in messages)
    assert any("seed=3 (was 1234)" in m for m in messages)


def test_config_file_unknown_key_is_an_error_with_a_suggestion(tmp_path):
    path = write_yaml(tmp_path, "num_rolout: 7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'num_rolout'; did you mean num_rollout\?"):
        parse_args(BASE + ["--custom-config-path", path])


@pytest.mark.parametrize("text,match", [
    ("custom_config_path: other.yaml\n", "unknown key"),
    ("rollout_batch_size: zero\n", "rollout_batch_size"),
    ("rollout_batch_size: 0\n", "must be >= 1"),
    ("colocate: 1\n", "expected true or false"),
    ("device: tpu\n", "not one of cuda, cpu"),
    ("lr: [1, 2]\n", "expected a single value"),
    ("- lr\n", "expected a mapping"),
    ("lr: [\n", "not valid YAML"),
])
def test_config_file_bad_content_is_a_config_error(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(BASE + ["--custom-config-path", write_yaml(tmp_path, text)])


def test_config_file_that_cannot_be_read_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_args(BASE + ["--custom-config-path", str(tmp_path / "missing.yaml")])


def test_config_file_overrides_are_validated(tmp_path):
    path = write_yaml(tmp_path, "save_interval: 5\n")
    with pytest.raises(ConfigError, match="--save-interval 5 needs --save"):
        parse_args(BASE + ["--custom-config-path", path])


def test_empty_config_file_changes_nothing(tmp_path):
    ns = parse_args(BASE + ["--custom-config-path", write_yaml(tmp_path, "")])
    assert ns.num_rollout == 2
