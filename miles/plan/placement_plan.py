"""The run's layout from the flags alone (no Ray): one placement group whose bundles hold train
ranks, engines and rewards, and what the reward workers ask for outside it.

GPU jobs get one bundle per train GPU and per rollout engine (`--colocate`: engines share the
train bundles, each actor taking a fraction of the GPU). Reward workers that ask for GPUs get
their own (the reward pool asks Ray for them) unless `--colocate-reward` puts them in the engines'
bundles. CPU jobs (`--device cpu`) get CPU-only bundles with a fraction of a CPU each, sized to
leave the reward workers their quarter CPU, so two train ranks, an engine and a reward worker fit
a 2-CPU Ray head.

Ray-free: the launcher checks the layout against the cluster before it submits
(miles.plan.resource_fit), the driver before it waits for the group (miles.ray.placement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from miles.plan.resource_fit import Request


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
    reward: list[Slot] = field(default_factory=list)  # one per reward worker, only when colocated

    @property
    def device(self) -> str:
        return "cuda" if any(b.get("GPU") for b in self.bundles) else "cpu"


# shares of one bundle when several actors live in it (the reward pool asks for its own
# REWARD_CPU_PER_WORKER CPUs and --rm-num-gpus-per-worker GPUs)
_COLOCATED_TRAIN_GPU = 0.5
_COLOCATED_CPU = 0.25
# a reward actor's CPU share: a 2-CPU head then holds an engine, two train ranks and the reward
# pool at once (the reward work is short and mostly waits on models)
REWARD_CPU_PER_WORKER = 0.25


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
    """The bundles and each actor's slot, from the flags alone (no Ray).

    Reward workers are placed by the reward pool itself; they appear in the plan (as slots in the
    engines' bundles) only when `--colocate-reward` shares GPUs with the engines.
    """
    n_train = 0 if args.debug_rollout_only else num_train_ranks(args)
    n_engines = 0 if args.train_only else num_rollout_engines(args)
    n_reward = 0 if args.train_only else num_reward_workers(args)
    if args.device == "cpu":
        return _plan_cpu(n_train, n_engines, n_reward, cpus_available)
    return _plan_gpu(args, n_train, n_engines, n_reward)


def _plan_cpu(n_train: int, n_engines: int, n_reward: int, cpus_available: float | None) -> PlacementPlan:
    n_actors = n_train + n_engines
    free = (cpus_available if cpus_available is not None else float(n_actors) + 1.0) - n_reward * REWARD_CPU_PER_WORKER
    # floor to 1/100 so the bundles always fit the head, whatever the float sum does
    share = min(1.0, math.floor(100 * free / max(1, n_actors)) / 100)
    if share <= 0:
        raise ValueError(f"{n_actors} train ranks and engines and {n_reward} reward workers do not fit "
                         f"{cpus_available} CPUs")
    bundles = [{"CPU": share} for _ in range(n_actors)]
    slots = [Slot(i, share, 0.0) for i in range(n_actors)]
    return PlacementPlan(bundles, slots[:n_train], slots[n_train:])


def _plan_gpu(args, n_train: int, n_engines: int, n_reward: int) -> PlacementPlan:
    per_engine = args.rollout_num_gpus_per_engine
    if per_engine != 1:  # the validator refuses it first; never reserve GPUs an engine would not use
        raise ValueError(f"--rollout-num-gpus-per-engine {per_engine}: an engine runs on one device; use 1")
    reward_gpus = float(getattr(args, "rm_num_gpus_per_worker", 0.0) or 0.0)
    colocate_reward = bool(getattr(args, "colocate_reward", False)) and reward_gpus > 0 and n_engines > 0
    colocated = args.colocate and n_train > 0
    bundles: list[dict[str, float]] = []
    train, rollout, reward = [], [], []
    for _ in range(n_train):
        bundles.append({"GPU": 1.0, "CPU": 1.0})
        if colocated:
            train.append(Slot(len(bundles) - 1, _COLOCATED_CPU, _COLOCATED_TRAIN_GPU))
        else:
            train.append(Slot(len(bundles) - 1, 1.0, 1.0))
    engine_gpu = float(per_engine)
    if colocated:
        engine_gpu = 1.0 - _COLOCATED_TRAIN_GPU
    if colocate_reward:
        hosts_per_bundle = math.ceil(n_reward / n_engines)
        engine_gpu -= hosts_per_bundle * reward_gpus
        if engine_gpu <= 0:
            raise ValueError(f"--colocate-reward: {n_reward} reward workers x {reward_gpus} GPU leave the engines none")
    for e in range(n_engines):
        if colocated:
            rollout.append(Slot(e % n_train, _COLOCATED_CPU, engine_gpu))
        else:
            bundles.append({"GPU": float(per_engine), "CPU": 1.0})
            rollout.append(Slot(len(bundles) - 1, 1.0 - (REWARD_CPU_PER_WORKER if colocate_reward else 0), engine_gpu))
    if colocate_reward:
        reward = [Slot(rollout[w % n_engines].bundle_index, REWARD_CPU_PER_WORKER, reward_gpus) for w in range(n_reward)]
    return PlacementPlan(bundles, train, rollout, reward)


def layout_requests(args, plan: PlacementPlan) -> list[Request]:
    """What the run asks the cluster for: the placement group's bundles, and each reward worker
    that Ray places on its own (outside the group)."""
    n_train, n_engines = len(plan.train), len(plan.rollout)
    what = " and ".join(part for part in (f"{n_train} train rank(s)" if n_train else "",
                                          f"{n_engines} rollout engine(s)" if n_engines else "") if part)
    requests = [Request(f"the placement group of {what or 'the run'}", list(plan.bundles))] if plan.bundles else []
    if not plan.reward and not args.train_only:
        gpus = 0.0 if args.device == "cpu" else float(getattr(args, "rm_num_gpus_per_worker", 0.0) or 0.0)
        shape = {"CPU": REWARD_CPU_PER_WORKER, **({"GPU": gpus} if gpus else {})}
        requests += [Request(f"reward worker {w}", [shape]) for w in range(num_reward_workers(args))]
    return requests
