"""The host side of the memory plan (miles/plan/host_plan.py): per node the driver, the object
store, reward workers, engines and ranks; offload arenas without rounding; a node over its host
budget refused like a GPU; the eval's cost printed."""

from __future__ import annotations

import pytest

from miles.flags.arguments import ConfigError, parse_and_plan
from miles.plan.memory_plan import GIB, MemoryPlanError, build_memory_plan, plan_and_check

# the Wan2.2 17-GPU recipe's full-scale layout: 2 train nodes of 8 colocated ranks and engines, a reward node
WAN_17 = ("--hf-checkpoint /nowhere/Wan2.2-T2V-A14B-Diffusers --diffusion-model-family wan2_2 --num-rollout 2 "
          "--rm-type pickscore --pickscore-model-path /nowhere/PickScore_v1 --rm-num-workers 4 "
          "--rm-num-gpus-per-worker 0.25 --prompt-data p.jsonl --rollout-batch-size 16 --n-samples-per-prompt 16 "
          "--diffusion-height 480 --diffusion-width 832 --diffusion-output-num-frames 33 --diffusion-num-steps 20 "
          "--diffusion-num-sde-steps 2 --diffusion-sde-window-max-start 16 --diffusion-guidance-scale-2 3.0 "
          "--param-dtype float32 --compute-dtype bfloat16 --rollout-dtype bfloat16 "
          "--update-weight-target-module transformer transformer_2 --train-backend fsdp --offload-train "
          "--offload-rollout --micro-batch-size 1 --rollout-microgroup-size 1 --gradient-checkpointing "
          "--rollout-num-gpus 16 --actor-num-nodes 2 --actor-num-gpus-per-node 8 --num-nodes 3 --num-gpus-per-node 8 "
          "--colocate --diffusion-debug-mode --gpu-memory-gb 141 --eval-interval 100 --eval-num-prompts 64 "
          "--skip-eval-before-train").split()


def _host(argv):
    return build_memory_plan(*parse_and_plan(argv)).host


def test_each_node_holds_its_own_processes_and_the_driver_never_the_samples():
    host = _host(WAN_17)
    node0, node1, reward = host.nodes
    assert (node0.roles.driver, node0.roles.ranks, node0.roles.engines) == (True, 8, 8)
    assert (node1.roles.driver, node1.roles.ranks, node1.roles.engines) == (False, 8, 8)
    assert (reward.roles.ranks, reward.roles.engines, reward.roles.gpu_rewards) == (0, 0, 4)
    driver = node0.parts["driver (prompts, references, rewards, thumbnails)"]["rollout"]
    assert driver < 2 * 2 ** 20  # a rollout of 256 videos: references and thumbnails, about a MiB
    # what the driver used to hold: every sample's whole path and decoded video in float32
    assert 256 * host.sample.full_trajectory > 60 * GIB
    # the object store holds each sample as the ranks read it: a fraction of that
    assert host.sample.trajectory < 0.1 * host.sample.full_trajectory
    assert node0.total / GIB < host.budget_gib and "pinned: offload arenas of exactly their size" in host.notes[-1]


def test_host_memory_gb_decides_the_verdict():
    assert _host([*WAN_17, "--host-memory-gb", "1024"]).budget_gib == pytest.approx(921.6)
    with pytest.raises(MemoryPlanError) as err:
        plan_and_check(*parse_and_plan([*WAN_17, "--host-memory-gb", "512"]))
    message = str(err.value)
    assert message.startswith("host memory plan: node 0 (driver, 8 train ranks, 8 engines) needs an estimated")
    assert "engines x 8" in message and "(--host-memory-gb 512 minus 10% headroom)" in message
    assert "--actor-num-gpus-per-node" in message


def test_host_memory_gb_is_refused_on_the_cpu():
    argv = ["--hf-checkpoint", "/ckpt/sd3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
            "--prompt-data", "p.jsonl", "--device", "cpu", "--host-memory-gb", "64"]
    with pytest.raises(ConfigError, match="--host-memory-gb 64 with --device cpu.*fix: drop --host-memory-gb"):
        parse_and_plan(argv)


def test_the_plan_prints_the_evals_size_and_cost_and_says_when_it_is_unbounded():
    text = build_memory_plan(*parse_and_plan(WAN_17)).table()
    line = next(line for line in text.splitlines() if line.startswith("eval:"))
    # 64 prompts x 20 steps against 256 samples x 20 steps: a quarter of a rollout's sampling
    assert line.startswith("eval: 64 prompts x 20 steps every 100 rollouts: 0.25 of a training rollout's sampling")
    assert "on 16 engines" in line and "before training" not in line
    unbounded = [a for a in WAN_17 if a not in ("--eval-num-prompts", "64", "--skip-eval-before-train")]
    text = build_memory_plan(*parse_and_plan(unbounded)).table()
    assert "every prompt of p.jsonl x 20 steps every 100 rollouts, and once before training" in text
