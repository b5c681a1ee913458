"""The memory plan's phases (setup, train, weight push, checkpoint save, rollout) and host memory
per node; miles.replay checks them against the real code (tests/unit/replay)."""

from __future__ import annotations

from miles.replay.doc_table import repo_root
from miles.replay.recipe import recipe_flags
from miles.plan.memory_plan import GIB, PHASES, RESUME, phase_plan

WAN_17GPU = "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"


def test_an_offloaded_engine_holds_nothing_on_its_gpu_while_the_rank_trains_or_saves():
    ns, plan = recipe_flags(repo_root() / WAN_17GPU, "full")
    phases = phase_plan(ns, plan)
    train_gpu = phases.gpus["train GPU"]
    assert set(train_gpu) == {*PHASES, RESUME}
    # both sides offload: the train step and the save carry the rank alone, the rollout the engine
    # plus nothing of the rank's models
    assert train_gpu["checkpoint save"] < min(train_gpu["weight push"], train_gpu["rollout"])
    assert [n.roles.index for n in phases.host.nodes] == [0, 1, 2] and all(n.total > 0 for n in phases.host.nodes)


def test_without_offload_the_rank_keeps_its_state_through_the_rollout():
    ns, plan = recipe_flags(repo_root() / WAN_17GPU, "full")
    ns.offload_train = ns.offload_rollout = False
    on = phase_plan(ns, plan).gpus["train GPU"]
    assert on["rollout"] - on["setup"] > 10 * GIB  # the engine's working set and the rank's optimizer state


def test_a_resume_loads_the_ranks_state_beside_the_engine_it_set_up():
    ns, plan = recipe_flags(repo_root() / WAN_17GPU, "full")
    train_gpu = phase_plan(ns, plan).gpus["train GPU"]
    # the engine has not sampled yet, so it is resident beside the rank's whole state
    assert train_gpu[RESUME] > train_gpu["checkpoint save"] + 50 * GIB
