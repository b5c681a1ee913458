"""The job a recipe's execute() builds (U.colocated_job, U.TrainJob) and the base of a scaled
recipe's ScriptArgs (U.ScaledRecipeArgs): what they share, and the order they put it in."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

import miles.launcher.recipe_api as U
from miles.launcher import train_job


@dataclass(frozen=True, kw_only=True)
class _Scale(U.ColocatedScale):
    pass


FULL = _Scale(U.FULL_SCALE, train_ranks=4, num_steps=10, rollout_batch_size=8, n_samples_per_prompt=4,
              rm_num_workers=4, reward_gpus=1, num_prompts=100, num_rollout=300, eval_interval=10,
              eval_prompts=64, save_interval=20, sharded=True)
CPU = _Scale(U.CPU_PROXY, train_ranks=2, num_steps=6, rollout_batch_size=2, n_samples_per_prompt=4,
             rm_num_workers=1, num_prompts=16, num_rollout=2)
ASSETS = U.Assets("/m/ckpt", "/d/p.jsonl", "/d/eval.jsonl", "/m/PickScore_v1")
OWN = {"rollout_args": "--rollout ", "grpo_args": "--grpo ", "optimizer_args": "--optimizer ",
       "lora_args": "--lora ", "perf_args": "--perf "}


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return U.ExecuteTrainConfig(output_dir=str(tmp_path), run_id="r1")


def test_blocks_join_in_the_canonical_order_whatever_order_they_are_given_in(config):
    job = U.TrainJob("run_x.py", config, 0, ckpt_args="--ckpt ", misc_args="--misc ")
    given = dict(reversed(list({**OWN, "eval_args": "--eval ", "reward_args": "--reward ", "engine_args": "--engine ",
                                "train_backend_args": "--backend "}.items())))
    words = shlex.split(job.train_args(**given))
    assert words == ["--ckpt", "--rollout", "--eval", "--grpo", "--optimizer", "--lora", "--reward", "--engine",
                     "--backend", "--perf", "--misc"]


def test_a_block_the_recipe_gives_replaces_the_jobs_own(config):
    job = U.TrainJob("run_x.py", config, 0, reward_args="--rm-type pickscore ")
    assert "--rm-type ocr" in job.train_args(**OWN, reward_args="--rm-type ocr ")
    assert "pickscore" not in job.train_args(**OWN, reward_args="--rm-type ocr ")


def test_a_missing_recipe_block_or_an_unknown_block_is_refused_by_name(config):
    job = U.TrainJob("run_x.py", config, 0)
    with pytest.raises(TypeError, match=r"missing the recipe's blocks \['lora_args'\]"):
        job.train_args(**{k: v for k, v in OWN.items() if k != "lora_args"})
    with pytest.raises(TypeError, match=r"unknown blocks \['sampler_args'\]"):
        job.train_args(**OWN, sampler_args="--x ")


def test_wandb_flags_come_last_named_after_the_recipe_file_and_never_carry_the_key(config, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-123")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    words = shlex.split(U.TrainJob("/repo/scripts/run_x.py", config, 0).train_args(**OWN))
    assert words[-7:] == ["--use-wandb", "--wandb-group", "run_x", "--wandb-project", "miles-diffusion",
                          "--wandb-run-name", "run_x-r1"]
    assert not any("sekrit" in word for word in words)


def test_colocated_job_shares_what_every_colocated_pickscore_recipe_writes(config):
    job = U.colocated_job("run_x.py", config, ASSETS, "sd3", FULL, 80)
    assert job.ckpt_args == U.ckpt_args("sd3", "/m/ckpt", config, 20)
    # the scale's eval size, and none before training (miles-diffusion's recipes skip it)
    assert job.eval_args == ("--eval-interval 10 --eval-prompt-data /d/eval.jsonl --eval-num-prompts 64 "
                             "--skip-eval-before-train ")
    before = dataclasses.replace(FULL, eval_prompts=None, eval_before_train=True)
    assert U.colocated_job("scripts/run_x.py", config, ASSETS, "sd3", before, 80).eval_args == (
        "--eval-interval 10 --eval-prompt-data /d/eval.jsonl ")
    assert job.reward_args == U.pickscore_args("/m/PickScore_v1", FULL)
    assert job.engine_args == U.engine_args(4)
    assert job.train_backend_args == U.train_backend_args("bfloat16", sharded=True)
    # the reward GPU is a fifth GPU of the node
    assert job.misc_args == U.colocated_misc_args(FULL, 80, 4, 5) and job.num_gpus_per_node == 5


def test_a_cpu_colocated_job_asks_ray_for_no_gpu_and_has_no_reward_without_pickscore(config):
    job = U.colocated_job("run_x.py", config, ASSETS._replace(pickscore=""), "sd3", CPU, 80)
    assert job.num_gpus_per_node == 0 and job.reward_args == ""
    assert "--device cpu" in job.misc_args and "--gpu-memory-gb" not in job.misc_args


def test_a_multi_node_colocated_job_counts_engines_over_its_train_nodes(config):
    job = U.colocated_job("run_x.py", config, ASSETS, "wan2_2", FULL, 141, train_gpus=8, gpus_per_node=8,
                          train_nodes=2, job_nodes=3, ray_head_port=6379)
    assert job.engine_args == U.engine_args(16) and job.ray_head_port == 6379
    assert "--actor-num-nodes 2 --actor-num-gpus-per-node 8 --num-nodes 3 --num-gpus-per-node 8" in job.misc_args


def test_execute_train_hands_the_joined_flags_and_the_launch_options_on(config, monkeypatch):
    seen = {}
    monkeypatch.setattr(train_job, "execute_train", lambda **kwargs: seen.update(kwargs))
    job = U.TrainJob("run_x.py", config, 4, ckpt_args="--ckpt ", locked_flags={"--lr": "1e-4"})
    job.execute_train(**OWN)
    assert seen == {"train_args": job.train_args(**OWN), "num_gpus_per_node": 4, "config": config,
                    "locked_flags": {"--lr": "1e-4"}, "before_ray_job_submit": None, "ray_head_port": None}


@dataclass
class _ScriptArgs(U.ScaledRecipeArgs):
    scale: Literal["full", "cpu-proxy"] = U.scale_option("full: the real run; cpu-proxy: ours on CPU.")
    num_rollout: Optional[int] = U.num_rollout_option({"full": FULL, "cpu-proxy": CPU})
    kl_beta: float = dataclasses.field(default=0.04, metadata={"help": "KL weight."})


def test_a_scaled_recipes_options_keep_their_order_with_its_own_scales_and_help():
    names = [f.name for f in dataclasses.fields(_ScriptArgs)]
    shared = [f.name for f in dataclasses.fields(U.ExecuteTrainConfig)]
    assert names == [*shared, "scale", "num_rollout", "model_dir", "data_dir", "kl_beta"]
    scale = next(f for f in dataclasses.fields(_ScriptArgs) if f.name == "scale")
    assert scale.default == "full" and scale.metadata["help"] == "full: the real run; cpu-proxy: ours on CPU."
    assert _ScriptArgs.__dataclass_fields__["num_rollout"].metadata["help"].endswith("300 (full), 2 (cpu-proxy).")
