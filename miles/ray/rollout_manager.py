"""The rollout side of the loop: prompt data, rollout engines and the reward pool.

Lives in the driver. `generate(rollout_id)` draws the next prompts, deals whole prompt groups to
the engines, scores the samples and turns rewards into advantages; `update_weights` pushes the
trainer's weights into every engine in place.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import torch

from miles.backends.loss import compute_advantages
from miles.backends.lora import LoraSpec
from miles.backends.types import RolloutBatch
from miles.models.runtime import actor_threads
from miles.ray import faults
from miles.ray.faults import ROSTER, wait_for, watch_creation
from miles.ray.placement import PlacementPlan, actor_options
from miles.rollout.data import PromptDataset, read_prompt_file
from miles.ray.reward_pool import RewardPool
from miles.rollout.rm_hub.pool import split_evenly
from miles.rollout.rm_hub.types import RewardSample
from miles.rollout.step_strategy import trained_steps_for_rollout
from miles.rollout.types import SampleRequest, Trajectory

EVAL_SEED_OFFSET = 10_000_019  # eval noise never coincides with a training rollout's


def without_images(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The trajectories as the trainer needs them: pixels were for the reward and cost transfer time."""
    return [dataclasses.replace(t, image=torch.empty(0)) for t in trajectories]


def sample_seed(rollout_seed: int, rollout_id: int, group: int, sample: int) -> int:
    """A sample's noise seed: a function of its place alone, so resumes and engine counts agree."""
    return zlib.crc32(f"{rollout_seed}:{rollout_id}:{group}:{sample}".encode())


class RolloutManager:
    def __init__(self, args, placement: PlacementPlan, pg, runtime_env: dict | None = None):
        import ray

        from miles.rollout.engine import create_engine_actor

        self.args = args
        self.dataset = PromptDataset.from_args(args)
        self.engines = [create_engine_actor(a, actor_threads(args.device), **actor_options(pg, slot, runtime_env))
                        for a, slot in zip(faults.args_per_engine(args, len(placement.rollout)), placement.rollout)]
        watch_creation(self.engines, "rollout engine")
        colocated = [s.bundle_index for s in placement.reward]
        self.rewards = RewardPool(args, placement_group=pg if colocated else None, bundle_indices=colocated or None)
        wait_for([e.ready.remote() for e in self.engines], self.engines, "engine start")
        ROSTER.register(self.engines, "rollout engine")
        self.last_images: list[torch.Tensor] = []
        self.last_captions: list[tuple[str, float]] = []  # (prompt, reward) of each of last_images

    def _sample(self, requests: list[SampleRequest], trained_steps: list[int], debug: bool,
                what: str = "generate") -> list[Trajectory]:
        import ray

        groups = sorted({r.group_index for r in requests})
        futures, engines = [], []
        for engine, (start, stop) in zip(self.engines, split_evenly(len(groups), len(self.engines))):
            mine = set(groups[start:stop])
            futures.append(engine.generate.remote([r for r in requests if r.group_index in mine], trained_steps, debug,
                                                  what == "eval"))
            engines.append(engine)
        return [t for part in wait_for(futures, engines, what) for t in part]

    def _score(self, trajectories: list[Trajectory]) -> list[float]:
        return self.rewards.score([RewardSample(t.prompt, t.image, t.metadata) for t in trajectories])

    def generate(self, rollout_id: int) -> tuple[RolloutBatch, dict[str, float]]:
        args = self.args
        start = time.perf_counter()
        n = args.n_samples_per_prompt
        prompts = self.dataset.next_batch(args.rollout_batch_size)
        requests = [SampleRequest(item.prompt, g, j, sample_seed(args.rollout_seed, rollout_id, g, j), dict(item.metadata))
                    for g, item in enumerate(prompts) for j in range(n)]
        trained_steps = trained_steps_for_rollout(args, rollout_id)
        trajectories = self._sample(requests, trained_steps, args.diffusion_debug_mode)
        generated = time.perf_counter()
        rewards = self._score(trajectories)
        for t, r in zip(trajectories, rewards):
            t.reward = r
        advantages = compute_advantages(torch.tensor(rewards), n, globalize_mean=args.globalize_reward_mean,
                                        globalize_std=args.globalize_reward_std, adv_clip_max=args.diffusion_adv_clip_max,
                                        estimator=args.advantage_estimator)
        self.last_images = [t.image for t in trajectories]
        self.last_captions = [(t.prompt, r) for t, r in zip(trajectories, rewards)]
        reward_t = torch.tensor(rewards, dtype=torch.float64)
        metrics = {
            "rollout/reward/raw_mean": float(reward_t.mean()),
            "rollout/reward/raw_std": float(reward_t.std(unbiased=False)),
            "rollout/advantage_abs_mean": float(advantages.abs().mean()),
            "rollout/trained_steps": len(trained_steps),
            "perf/rollout_time": time.perf_counter() - start,
            "perf/reward_time": time.perf_counter() - generated,
        }
        batch = RolloutBatch(rollout_id, without_images(trajectories), rewards, advantages.tolist(), trained_steps)
        return batch, metrics

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Mean reward of deterministic (all-ODE) samples of the eval prompts, one per prompt."""
        args = self.args
        items = read_prompt_file(args.eval_prompt_data or args.prompt_data, args.input_key, args.metadata_key)
        items = items[:args.eval_num_prompts] if args.eval_num_prompts else items
        requests = [SampleRequest(item.prompt, g, 0, sample_seed(args.rollout_seed, EVAL_SEED_OFFSET, g, 0),
                                  dict(item.metadata)) for g, item in enumerate(items)]
        trajectories = self._sample(requests, [], False, what="eval")
        rewards = self._score(trajectories)
        # as the engines ran them (--diffusion-eval-num-steps), read off the samples' schedules
        steps = max(len(t.sigmas) - 1 for t in trajectories)
        metrics = {"eval/reward/raw_mean": sum(rewards) / len(rewards), "eval/denoising_steps": steps,
                   "eval/num_prompts": len(rewards)}
        if getattr(args, "eval_prompt_name", None):  # `--eval-prompt-data NAME PATH` (miles-diffusion's form)
            metrics[f"eval/{args.eval_prompt_name}/reward/raw_mean"] = metrics["eval/reward/raw_mean"]
        return metrics

    def apply_lora(self, spec: LoraSpec, components: list[str]) -> None:
        import ray

        config = {"rank": spec.rank, "alpha": spec.alpha, "target_modules": list(spec.target_modules),
                  "components": components}
        wait_for([e.apply_lora.remote(config) for e in self.engines], self.engines, "apply_lora")

    def update_weights(self, updates: list[tuple[str, object]]) -> None:
        """`updates`: (component, object ref of its state dict); every engine copies them in place."""
        import ray

        pairs = [(e, component, ref) for e in self.engines for component, ref in updates]
        wait_for([e.load_weights.remote(component, ref) for e, component, ref in pairs], [e for e, _, _ in pairs],
                 "load_weights")

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])

    def shutdown(self) -> None:
        import ray

        self.rewards.shutdown()
        faults.WATCH.forget(self.engines)
        for engine in self.engines:
            ray.kill(engine)
