"""Where every actor runs: the placement group of the layout (miles.plan.placement_plan), reserved
only when the cluster can hold it, and each actor's options pinning it to its slot.

`create_placement_group` judges the layout against the alive nodes first (miles.plan.resource_fit):
a layout no node set can ever hold ends the run at once, naming the request and what the cluster
offers; one that fits but is busy (other work holds the resources) or waits for nodes still to join
is waited for, with a progress line every PROGRESS_EVERY_S naming what is pending and what holds
it, up to `--placement-timeout-s`. While it waits, actors created earlier are watched
(miles.ray.faults.wait_for): a death in a constructor ends the wait too.
"""

from __future__ import annotations

import time

from miles.plan.placement_plan import (  # noqa: F401  (the driver's names for the layout)
    REWARD_CPU_PER_WORKER,
    PlacementPlan,
    Slot,
    layout_requests,
    num_reward_workers,
    num_rollout_engines,
    num_train_ranks,
    plan_placement,
)
from miles.plan.resource_fit import MISSING_NODES, NodeOffer, Request, Verdict, judge, show_shape, total


PROGRESS_EVERY_S = 30.0
_POLL_S = 1.0
_SHOWN = ("GPU", "CPU", "memory")  # what a node offer shows; Ray's bookkeeping keys are left out


def alive_nodes() -> list[NodeOffer]:
    """The alive nodes and their totals (the GCS's view: works without a dashboard)."""
    import ray

    return [NodeOffer(n.get("NodeManagerAddress") or n.get("NodeID", "?")[:12],
                      {k: float(v) for k, v in (n.get("Resources") or {}).items() if k in _SHOWN})
            for n in ray.nodes() if n.get("Alive")]


def place_run(args, say=print):
    """The driver's placement: wait for the nodes the job expects (`--num-nodes`), plan the layout
    on them, reserve it. Returns (plan, placement group); each wait ends by --placement-timeout-s."""
    import ray

    wait_for_nodes(args.num_nodes, args.placement_timeout_s, say=say)
    plan = plan_placement(args, ray.cluster_resources().get("CPU"))
    return plan, create_placement_group(plan, layout_requests(args, plan), expected_nodes=args.num_nodes,
                                        timeout_s=args.placement_timeout_s, say=say)


def wait_for_nodes(expected: int, timeout_s: float, *, progress_every_s: float = PROGRESS_EVERY_S, say=print) -> None:
    """Until `expected` nodes are alive: a job laid out for N nodes is planned on all of them.
    A progress line every `progress_every_s`; faults.PlacementFailure after `timeout_s`."""
    from miles.ray import faults

    start = time.monotonic()
    next_note = start  # the first line at once: the wait is news
    waited_for = False
    while len(nodes := alive_nodes()) < expected:
        waited_for = True
        waited = time.monotonic() - start
        alive = "; ".join(n.show() for n in nodes) or "none"
        if waited >= timeout_s:
            raise faults.PlacementFailure(f"the job expects {expected} node(s) (--num-nodes) and only {len(nodes)} "
                                          f"joined within --placement-timeout-s {timeout_s:g} (alive: {alive})",
                                          faults.INFRASTRUCTURE, _head())
        if time.monotonic() >= next_note:
            say(f"placement: waiting {waited:.0f}s of {timeout_s:g}s (--placement-timeout-s) for nodes: the job expects "
                f"{expected} (--num-nodes), {len(nodes)} alive ({alive})", flush=True)
            next_note += progress_every_s
        faults.watchful_sleep(min(_POLL_S, timeout_s - waited))
    if waited_for:
        say(f"placement: {len(nodes)} node(s) alive after {time.monotonic() - start:.0f}s; placing the run", flush=True)


def create_placement_group(plan: PlacementPlan, requests: list[Request] | None = None, *, expected_nodes: int = 1,
                           timeout_s: float = 600.0, progress_every_s: float = PROGRESS_EVERY_S,
                           say=print):
    """Reserve the plan's bundles (module docstring). `requests`: everything the run asks the
    cluster for (layout_requests), judged together; default: the bundles alone. Raises
    faults.PlacementFailure: at once when the cluster can never hold them, after `timeout_s` when
    it did not; `say` gets a progress line every `progress_every_s` meanwhile."""
    import ray
    from ray.util.placement_group import placement_group

    from miles.ray import faults

    requests = requests if requests is not None else [Request("the placement group", list(plan.bundles))]
    verdict = _judge_or_fail(requests, expected_nodes)
    if not plan.bundles:
        return None
    pg = placement_group(plan.bundles, strategy="PACK")
    start = time.monotonic()
    next_note = start + progress_every_s
    try:
        while True:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise faults.PlacementFailure(
                    f"not placed within --placement-timeout-s {timeout_s:g}: {_pending(requests, verdict)}; "
                    f"{holders(pg)}", faults.INFRASTRUCTURE, _head())
            if faults.wait_ready(pg.ready(), min(_POLL_S, timeout_s - waited)):
                return pg
            verdict = _judge_or_fail(requests, expected_nodes)  # a node may have left, or joined
            if time.monotonic() >= next_note:
                say(f"placement: waiting {time.monotonic() - start:.0f}s of {timeout_s:g}s (--placement-timeout-s): "
                    f"{_pending(requests, verdict)}; {holders(pg)}", flush=True)
                next_note += progress_every_s
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise


def _judge_or_fail(requests: list[Request], expected_nodes: int) -> Verdict:
    from miles.ray import faults

    verdict = judge(requests, alive_nodes(), expected_nodes)
    if verdict.never:
        raise faults.PlacementFailure(f"unschedulable: {verdict.reason}", faults.DETERMINISTIC, _head())
    return verdict


def _head() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _pending(requests: list[Request], verdict: Verdict) -> str:
    asked = show_shape(total([b for r in requests for b in r.bundles]))
    if verdict.state == MISSING_NODES:
        return f"pending {asked} for {' + '.join(r.what for r in requests)}; {verdict.reason}"
    return f"pending {asked} for {' + '.join(r.what for r in requests)}"


def holders(own_pg=None) -> str:
    """What holds the cluster's resources now: free vs total, and the other placement groups."""
    import ray

    free, whole = ray.available_resources(), ray.cluster_resources()
    used = {k: whole[k] - free.get(k, 0.0) for k in _SHOWN if k in whole}
    own = own_pg.id.hex() if own_pg is not None else None
    groups = []
    for pg_id, entry in ray.util.placement_group_table().items():
        if pg_id == own or entry.get("state") != "CREATED":
            continue
        shape = total(list((entry.get("bundles") or {}).values()))
        groups.append(f"placement group {pg_id[:12]}{' ' + entry['name'] if entry.get('name') else ''} "
                      f"{show_shape({k: v for k, v in shape.items() if k in _SHOWN})}")
    held = "; ".join(groups) if groups else "no other placement group (actors outside groups hold the rest)"
    return f"in use {show_shape(used)} of {show_shape({k: whole[k] for k in _SHOWN if k in whole})}; held by: {held}"


def actor_options(pg, slot: Slot, runtime_env: dict | None = None) -> dict:
    """`.options(**...)` that pins an actor to its slot."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus,
               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                   placement_group=pg, placement_group_bundle_index=slot.bundle_index)}
    if runtime_env:
        options["runtime_env"] = runtime_env
    return options
