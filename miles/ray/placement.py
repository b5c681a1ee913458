"""Where every actor runs: one placement group whose bundles hold train ranks, engines and rewards.

GPU jobs get one bundle per train GPU and per rollout engine (`--colocate`: engines share the
train bundles, each actor taking a fraction of the GPU), and reward workers that ask for GPUs get
bundles of their own unless `--colocate-reward` puts them beside the engines. CPU jobs
(`--device cpu`) get CPU-only bundles with a fraction of a CPU each, so two train ranks, an engine
and a reward worker fit a 2-CPU Ray head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slot:
    """One actor's share of one bundle."""

    bundle_index: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PlacementPlan:
    bundles: list[dict[str, float]]
    train: list[Slot]
    rollout: list[Slot] = field(default_factory=list)  # one per engine
    reward: list[Slot] = field(default_factory=list)  # one per reward worker

    @property
    def device(self) -> str:
        return "cuda" if any(b.get("GPU") for b in self.bundles) else "cpu"


# shares of one GPU when several actors live in the same bundle
_COLOCATED_TRAIN_GPU = 0.45
_COLOCATED_ENGINE_GPU = 0.45
_COLOCATED_REWARD_GPU = 0.1


def num_train_ranks(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def num_rollout_engines(args) -> int:
    if getattr(args, "loss_type", None) == "sft_loss":
        return 0  # SFT trains on a fixed dataset: no engines
    gpus = args.rollout_num_gpus
    if gpus is None:
        gpus = num_train_ranks(args) if args.colocate else 1
    return max(1, gpus // max(1, args.rollout_num_gpus_per_engine))


def num_reward_workers(args) -> int:
    if getattr(args, "loss_type", None) == "sft_loss":
        return 0
    return max(0, int(getattr(args, "rm_num_workers", 1) or 0))


def plan_placement(args, cpus_available: float | None = None) -> PlacementPlan:
    """The bundles and each actor's slot, from the flags alone (no Ray)."""
    n_train = 0 if args.debug_rollout_only else num_train_ranks(args)
    n_engines = 0 if args.train_only else num_rollout_engines(args)
    n_reward = 0 if args.train_only else num_reward_workers(args)
    if args.device == "cpu":
        return _plan_cpu(n_train, n_engines, n_reward, cpus_available)
    return _plan_gpu(args, n_train, n_engines, n_reward)


def _plan_cpu(n_train: int, n_engines: int, n_reward: int, cpus_available: float | None) -> PlacementPlan:
    n_actors = n_train + n_engines + n_reward
    cpus = cpus_available if cpus_available is not None else float(n_actors)
    # floor to 1/100 so the bundles always fit the head, whatever the float sum does
    share = min(1.0, math.floor(100 * cpus / max(1, n_actors)) / 100)
    if share <= 0:
        raise ValueError(f"{n_actors} actors do not fit {cpus} CPUs")
    bundles = [{"CPU": share} for _ in range(n_actors)]
    slots = [Slot(i, share, 0.0) for i in range(n_actors)]
    return PlacementPlan(bundles, slots[:n_train], slots[n_train:n_train + n_engines], slots[n_train + n_engines:])


def _plan_gpu(args, n_train: int, n_engines: int, n_reward: int) -> PlacementPlan:
    per_engine = max(1, args.rollout_num_gpus_per_engine)
    bundles: list[dict[str, float]] = []
    train, rollout, reward = [], [], []
    colocated = args.colocate and n_train > 0 and per_engine == 1
    for _ in range(n_train):
        bundles.append({"GPU": 1.0, "CPU": 1.0})
        train.append(Slot(len(bundles) - 1, 1.0 if not colocated else 0.5, 1.0 if not colocated else _COLOCATED_TRAIN_GPU))
    for e in range(n_engines):
        if colocated:
            rollout.append(Slot(e % n_train, 0.5, _COLOCATED_ENGINE_GPU))
        else:
            bundles.append({"GPU": float(per_engine), "CPU": 1.0})
            rollout.append(Slot(len(bundles) - 1, 1.0, float(per_engine)))
    gpus_per_worker = float(getattr(args, "rm_num_gpus_per_worker", 0.0) or 0.0)
    for w in range(n_reward):
        if gpus_per_worker == 0:
            bundles.append({"CPU": 1.0})
            reward.append(Slot(len(bundles) - 1, 1.0, 0.0))
        elif getattr(args, "colocate_reward", False) and rollout:
            host = rollout[w % len(rollout)].bundle_index
            reward.append(Slot(host, 0.0, min(gpus_per_worker, _COLOCATED_REWARD_GPU)))
        else:
            bundles.append({"GPU": gpus_per_worker, "CPU": 1.0})
            reward.append(Slot(len(bundles) - 1, 1.0, gpus_per_worker))
    return PlacementPlan(bundles, train, rollout, reward)


def create_placement_group(plan: PlacementPlan, timeout_s: float = 600.0):
    """Reserve the plan's bundles; raises with the bundles named if the cluster cannot hold them."""
    import ray
    from ray.util.placement_group import placement_group

    if not plan.bundles:
        return None
    pg = placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(
            f"placement group of {len(plan.bundles)} bundles {plan.bundles} not ready after {timeout_s:.0f}s; "
            f"cluster has {ray.cluster_resources()}"
        )
    return pg


def actor_options(pg, slot: Slot, runtime_env: dict | None = None) -> dict:
    """`.options(**...)` that pins an actor to its slot."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus,
               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                   placement_group=pg, placement_group_bundle_index=slot.bundle_index)}
    if runtime_env:
        options["runtime_env"] = runtime_env
    return options
