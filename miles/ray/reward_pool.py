"""Reward workers as a pool of Ray actors (the in-process scorer: miles.rollout.rm_hub.pool).

The pool deals samples out in contiguous slices, one per worker, and puts the answers back in the
original order; a dead or silent worker ends the run naming it (miles.ray.faults).
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.ray import faults
from miles.ray.placement import REWARD_CPU_PER_WORKER
from miles.rollout.rm_hub.pool import split_evenly
from miles.rollout.rm_hub.scoring import score_samples
from miles.rollout.rm_hub.types import RewardError, RewardSample
from miles.rollout.rm_hub.wire import frames_to_send, reward_input
from miles.flags.debug_faults import fire


def wire_sample(args: Any, sample: RewardSample) -> RewardSample:
    """What a reward worker is sent for `sample` (miles.rollout.rm_hub.wire; in a run, the engine
    that decoded it makes this)."""
    return reward_input(sample.prompt, sample.image, sample.metadata, frames_to_send(args, sample.metadata))


class RewardWorker:
    """The body of one reward actor: keeps its models loaded between batches."""

    def __init__(self, args: Any) -> None:
        self.args = args

    async def score(self, samples: list[RewardSample], first_index: int) -> list[float]:
        fire(self, "reward-kill")
        fire(self, "reward-hang")
        return await score_samples(self.args, samples, first_index=first_index)

    async def score_stored(self, refs: list[Any], first_index: int) -> list[float]:
        """Score samples an engine left in the object store: fetched from there, not through the driver."""
        samples = list(await asyncio.gather(*refs))
        return await self.score(samples, first_index)

    def ready(self) -> bool:
        return True


def _actor_options(args: Any, placement_group: Any, bundle_index: int | None,
                   runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    gpus = float(getattr(args, "rm_num_gpus_per_worker", 0.0) or 0.0)
    if getattr(args, "device", "cuda") == "cpu":
        # on a CPU job the layout's "GPUs" are CPU worker slots: asking Ray for a GPU would hang
        gpus = 0.0
    options: dict[str, Any] = {"num_cpus": REWARD_CPU_PER_WORKER, "num_gpus": gpus}
    if runtime_env:
        options["runtime_env"] = runtime_env
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=-1 if bundle_index is None else bundle_index)
    return options


class RewardPool:
    """`--rm-num-workers` Ray actors, each with `--rm-num-gpus-per-worker` GPUs (0: a CPU actor).

    With `--colocate-reward` the caller passes the engines' placement group and a bundle per
    worker so the reward actors share those GPUs; otherwise Ray places them wherever their
    request fits. Requires `ray.init()` to have run.
    """

    def __init__(self, args: Any, *, placement_group: Any = None, bundle_indices: list[int] | None = None,
                 runtime_env: dict[str, Any] | None = None) -> None:
        import ray

        self.args = args
        num_workers = int(getattr(args, "rm_num_workers", 1) or 1)
        if bundle_indices is not None and len(bundle_indices) != num_workers:
            raise ValueError(f"{len(bundle_indices)} bundle indices for {num_workers} reward workers")
        actor_class = ray.remote(RewardWorker)
        self.workers = [
            actor_class.options(**_actor_options(args, placement_group, bundle_indices[i] if bundle_indices else None,
                                                 runtime_env))
            .remote(args)
            for i in range(num_workers)
        ]
        faults.watch_creation(self.workers, "reward worker")
        faults.wait_for([w.ready.remote() for w in self.workers], self.workers, "reward start")
        faults.ROSTER.register(self.workers, "reward worker")

    def _submit(self, samples: list[RewardSample]) -> list[Any]:
        wire = [wire_sample(self.args, s) for s in samples]
        return [self.workers[part].score.remote(wire[start:stop], start)
                for part, (start, stop) in enumerate(split_evenly(len(wire), len(self.workers)))]

    def _submit_stored(self, refs: list[Any]) -> list[Any]:
        return [self.workers[part].score_stored.remote(refs[start:stop], start)
                for part, (start, stop) in enumerate(split_evenly(len(refs), len(self.workers)))]

    @staticmethod
    def _unwrap(err: Exception) -> Exception:
        import ray.exceptions

        if isinstance(err, ray.exceptions.RayTaskError):
            cause = getattr(err, "cause", None)
            if isinstance(cause, RewardError):
                return RewardError(str(cause))
        if isinstance(err, ray.exceptions.RayActorError):
            return RewardError(f"a reward worker died: {err}")
        return err

    def score(self, samples: list[RewardSample]) -> list[float]:
        return self._gather(self._submit(samples))

    def score_stored(self, refs: list[Any]) -> list[float]:
        """Scores of samples the engines left in the object store (`StoredSample.reward_input`), in order."""
        return self._gather(self._submit_stored(refs))

    def _gather(self, refs: list[Any]) -> list[float]:
        try:  # a dead or silent worker: faults.RunFailure naming it (an infrastructure failure)
            parts = faults.wait_for(refs, self.workers[:len(refs)], "score")
        except faults.RunFailure:
            raise
        except Exception as err:
            raise self._unwrap(err) from err
        return [value for part in parts for value in part]

    async def ascore(self, samples: list[RewardSample]) -> list[float]:
        try:
            parts = await asyncio.gather(*self._submit(samples))
        except Exception as err:
            raise self._unwrap(err) from err
        return [value for part in parts for value in part]

    def shutdown(self) -> None:
        import ray

        faults.WATCH.forget(self.workers)
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
