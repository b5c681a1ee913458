"""A Wan2.2 checkpoint whose scheduler config moves the expert boundary away from the batch plan's
is refused when the train rank starts, naming --diffusion-shift; an agreeing one starts."""

import json
import shutil

import pytest

from miles.backends.actor import TrainRank
from miles.proxy_assets.checkpoint import ensure_checkpoint
from miles.models.runtime import configure_torch
from miles.proxy_assets.prompts import ensure_prompt_file
from miles.plan.command_line import parse_command_line
from miles.flags.batch_rules import ConfigError


def _argv(checkpoint, prompts, run_dir, extra=""):
    return (f"--hf-checkpoint {checkpoint} --diffusion-model-family wan2_2 --prompt-data {prompts} "
            f"--rollout-batch-size 1 --n-samples-per-prompt 2 "
            f"--num-rollout 1 --diffusion-height 32 --diffusion-width 32 --diffusion-output-num-frames 5 "
            f"--diffusion-num-steps 10 --diffusion-num-sde-steps 2 --diffusion-step-strategy-path sde_window "
            f"--diffusion-sde-window-max-start 2 --diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "
            f"--micro-batch-size-sample 2 --micro-batch-size-tstep 1 --update-weight-target-module transformer --rm-type brightness --use-lora "
            f"--lora-rank 4 --device cpu --actor-num-gpus-per-node 1 --num-gpus-per-node 1 --colocate "
            f"--run-dir {run_dir} "
            f"{extra}").split()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    configure_torch(num_threads=1)
    root = tmp_path_factory.mktemp("wan-phases")
    checkpoint = ensure_checkpoint("wan2_2", "tiny", 0, root)
    prompts = ensure_prompt_file("general", root / "prompts.jsonl", num_prompts=4)
    # the same weights under a scheduler config with another shift: the boundary moves
    moved = root / "moved-shift"
    shutil.copytree(checkpoint, moved)
    config_path = moved / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    key = "flow_shift" if "flow_shift" in config else "shift"
    config[key] = 5.0
    config_path.write_text(json.dumps(config))
    return checkpoint, moved, prompts, root


def test_a_checkpoint_whose_schedule_moves_the_expert_boundary_is_refused_naming_the_shift(assets):
    checkpoint, moved, prompts, root = assets
    args, plan = parse_command_line(_argv(moved, prompts, root / "run-moved"))
    with pytest.raises(ConfigError, match=r"expert boundary after step \d+ of 10, the batch plan .* after step "
                                          r"\d+; fix: pass --diffusion-shift"):
        TrainRank(args, plan, 0, 1).setup()


def test_the_same_checkpoint_starts_when_the_shift_is_given(assets):
    checkpoint, moved, prompts, root = assets
    for path, extra in ((checkpoint, ""), (moved, "--diffusion-shift 5.0")):
        args, plan = parse_command_line(_argv(path, prompts, root / "run-ok", extra))
        rank = TrainRank(args, plan, 0, 1)
        rank.setup()
        assert len(plan.experts) == 10 and set(plan.experts) == {"transformer", "transformer_2"}
