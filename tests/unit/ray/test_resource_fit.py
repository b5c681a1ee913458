"""The one rule that says whether a cluster can ever hold a run's layout (miles.plan.resource_fit),
as the driver and the launcher apply it; and which GPUs the launcher may declare."""

from __future__ import annotations

from types import SimpleNamespace

from miles.launcher.ray_cluster import declared_gpus, layout_verdict, this_machine, visible_gpus
from miles.plan.placement_plan import layout_requests, plan_placement
from miles.plan.resource_fit import FITS, MISSING_NODES, NEVER, NodeOffer, Request, judge

GIB = 2.0**30


def node(name: str, **resources: float) -> NodeOffer:
    return NodeOffer(name, resources)


def test_a_gpu_bundle_on_nodes_without_gpus_is_never_placeable_and_the_reason_names_request_and_offer():
    verdict = judge([Request("2 train ranks", [{"GPU": 1, "CPU": 1}] * 2)], [node("10.0.0.1", CPU=2)])
    assert verdict.state == NEVER
    assert "2 train ranks asks for {GPU: 1, CPU: 1} on one node" in verdict.reason
    assert "no node has GPU 1 (the most any node has: 0)" in verdict.reason
    assert "the cluster offers 1 node(s): 10.0.0.1 {CPU: 2}" in verdict.reason


def test_more_gpus_per_bundle_than_any_node_has_is_never_placeable_even_if_the_total_would_do():
    nodes = [node("a", GPU=4, CPU=8), node("b", GPU=4, CPU=8)]
    verdict = judge([Request("an engine", [{"GPU": 8}])], nodes)
    assert verdict.state == NEVER and "GPU 8 (the most any node has: 4)" in verdict.reason


def test_more_memory_per_bundle_than_any_node_has_is_named_in_gib():
    verdict = judge([Request("a reward worker", [{"CPU": 1, "memory": 64 * GIB}])], [node("a", CPU=4, memory=32 * GIB)])
    assert verdict.state == NEVER and "memory 64.0 GiB (the most any node has: 32.0 GiB)" in verdict.reason


def test_bundles_that_each_fit_but_not_together_are_never_placeable():
    nodes = [node("a", GPU=2, CPU=8), node("b", GPU=2, CPU=8)]
    verdict = judge([Request("5 engines", [{"GPU": 1}] * 5)], nodes)
    assert verdict.state == NEVER and "ask for {GPU: 5} in all" in verdict.reason


def test_packing_is_exact_where_first_fit_decreasing_would_refuse_a_layout_that_fits():
    # two 10-CPU nodes: 5+3+2 and 4+3+3 fill them exactly; first-fit-decreasing puts 5 and 4
    # together and has no room left for the last bundle
    nodes = [node("a", CPU=10), node("b", CPU=10)]
    sizes = [5, 4, 3, 3, 3, 2]
    assert judge([Request("mixed", [{"CPU": c} for c in sizes])], nodes).state == FITS
    assert judge([Request("mixed", [{"CPU": c} for c in [6, 6, 5, 3]])], nodes).state == NEVER  # 20 in all, but the 6s need a node each and the 5 fits beside neither


def test_a_layout_that_fits_the_totals_is_not_refused_however_busy_the_cluster_is():
    # totals, not what is free now: busy resources are waited for (the driver's progress lines)
    assert judge([Request("2 ranks", [{"CPU": 1}] * 2)], [node("a", CPU=2)]).state == FITS


def test_fewer_nodes_than_the_job_expects_is_a_wait_not_a_refusal():
    verdict = judge([Request("4 ranks", [{"CPU": 1}] * 4)], [node("a", CPU=2)], expected_nodes=2)
    assert verdict.state == MISSING_NODES
    assert "expects 2 node(s) (--num-nodes) and 1 are alive" in verdict.reason


def test_once_every_expected_node_is_there_a_layout_too_big_for_all_of_them_is_refused():
    verdict = judge([Request("4 ranks", [{"CPU": 1}] * 6)], [node("a", CPU=2), node("b", CPU=2)], expected_nodes=2)
    assert verdict.state == NEVER


def _flags(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None, rollout_num_gpus_per_engine=1,
                colocate=True, device="cuda", rm_num_workers=2, rm_num_gpus_per_worker=0.5, colocate_reward=False,
                debug_rollout_only=False, train_only=False, loss_type="policy_loss", num_nodes=1)
    return SimpleNamespace(**{**base, **kw})


def test_the_layout_requests_hold_the_group_and_the_reward_workers_placed_on_their_own():
    args = _flags()
    requests = layout_requests(args, plan_placement(args))
    assert [r.what for r in requests] == ["the placement group of 2 train rank(s) and 2 rollout engine(s)",
                                          "reward worker 0", "reward worker 1"]
    assert requests[1].bundles == [{"CPU": 0.25, "GPU": 0.5}]


def test_the_launcher_refuses_a_gpu_layout_on_a_machine_without_gpus_by_the_same_rule():
    verdict = layout_verdict(_flags(), this_machine(num_gpus=0, num_cpus=2))
    assert verdict.state == NEVER and "this machine {GPU: 0, CPU: 2}" in verdict.reason
    assert layout_verdict(_flags(), this_machine(num_gpus=3, num_cpus=8)).state == FITS
    # reward workers outside the group need their own half GPUs: 2 GPUs hold the ranks, not them
    assert layout_verdict(_flags(), this_machine(num_gpus=2, num_cpus=8)).state == NEVER


def test_a_cpu_layout_is_sized_to_the_cpus_and_fits():
    assert layout_verdict(_flags(device="cpu"), this_machine(num_gpus=0, num_cpus=2)).state == FITS


def test_the_launcher_declares_only_gpus_the_machine_has():
    none = lambda: (0, "no GPU found (NVML: NVMLError_LibraryNotFound)")  # noqa: E731
    four = lambda: (4, "NVML sees 4 GPU(s)")  # noqa: E731
    assert declared_gpus(3, visible_gpus(None, {}, nvml=none)) == 0
    assert declared_gpus(3, visible_gpus(None, {}, nvml=four)) == 3
    assert declared_gpus(8, visible_gpus(None, {}, nvml=four)) == 4
    assert visible_gpus("0,1", {}, nvml=four).count == 2  # the option narrows
    assert visible_gpus(None, {"CUDA_VISIBLE_DEVICES": "2"}, nvml=four).count == 1  # so does the environment
    listed = visible_gpus("0,1,2", {}, nvml=none)
    assert listed.count == 0 and "CUDA_VISIBLE_DEVICES=0,1,2 lists 3" in listed.how  # listing is not having
