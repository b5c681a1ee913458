"""The rollout side of the loop: prompt data, rollout engines and the reward pool.

Lives in the driver. `generate(rollout_id)` draws the next prompts, deals whole prompt groups to
the engines, has the samples scored and turns rewards into advantages; `update_weights` pushes the
trainer's weights into every engine in place.

The samples never pass through here: each engine keeps what it made in Ray's object store
(miles.rollout.engine_store), the reward workers fetch their frames from there and each train rank
its shard (`RolloutRefs`). The driver handles prompts, references, rewards, advantages and a few
thumbnails for the progress picture; an eval's samples are dropped once scored.
"""

from __future__ import annotations

import time
import zlib

import torch

from miles.backends.loss import compute_advantages
from miles.backends.lora import LoraSpec
from miles.backends.rollout_shard import probed_outputs
from miles.backends.types import RolloutRefs
from miles.models.runtime import actor_threads
from miles.ray import faults
from miles.ray.faults import ROSTER, wait_for, watch_creation
from miles.ray.placement import PlacementPlan, actor_options
from miles.ray.reward_pool import RewardPool
from miles.rollout.data import PromptDataset, read_prompt_file
from miles.rollout.rm_hub.pool import split_evenly
from miles.rollout.rm_hub.wire import frames_to_send
from miles.rollout.step_strategy import trained_steps_for_rollout
from miles.rollout.types import SampleRequest, StoredSample

EVAL_SEED_OFFSET = 10_000_019  # eval noise never coincides with a training rollout's
THUMBNAILS = 16  # samples of a rollout shown in last_rollout.png


def sample_seed(rollout_seed: int, rollout_id: int, group: int, sample: int) -> int:
    """A sample's noise seed: a function of its place alone, so resumes and engine counts agree."""
    return zlib.crc32(f"{rollout_seed}:{rollout_id}:{group}:{sample}".encode())


def thumbnail_samples(groups: int, per_group: int, count: int = THUMBNAILS) -> set[int]:
    """The samples shown in the progress picture: the first of each prompt, then the second, ..."""
    order = sorted(range(groups * per_group), key=lambda i: (i % per_group, i // per_group))
    return set(order[:count])


class RolloutManager:
    """`train_plan`: the batch plan of the train ranks that read the trajectories (it says which
    model outputs the parity probe compares); None when nobody trains on them (--debug-rollout-only):
    the engines then keep only what the reward workers score."""

    def __init__(self, args, placement: PlacementPlan, pg, runtime_env: dict | None = None, train_plan=None):
        from miles.rollout.engine import create_engine_actor

        self.args, self.train_plan = args, train_plan
        self.dataset = PromptDataset.from_args(args)
        self.engines = [create_engine_actor(a, actor_threads(args.device), **actor_options(pg, slot, runtime_env))
                        for a, slot in zip(faults.args_per_engine(args, len(placement.rollout)), placement.rollout)]
        watch_creation(self.engines, "rollout engine")
        colocated = [s.bundle_index for s in placement.reward]
        self.rewards = RewardPool(args, placement_group=pg if colocated else None, bundle_indices=colocated or None)
        wait_for([e.ready.remote() for e in self.engines], self.engines, "engine start")
        ROSTER.register(self.engines, "rollout engine")
        self.last_images: list[torch.Tensor] = []  # the last rollout's thumbnails, floats in [0, 1]
        self.last_captions: list[tuple[str, float]] = []  # (prompt, reward) of each of last_images

    def _sample(self, requests: list[SampleRequest], trained_steps: list[int], evaluation: bool, train: bool,
                what: str = "generate") -> list[StoredSample]:
        """Whole prompt groups dealt to the engines in order; their answers in request order."""
        groups = sorted({r.group_index for r in requests})
        futures, engines = [], []
        for engine, (start, stop) in zip(self.engines, split_evenly(len(groups), len(self.engines))):
            mine = set(groups[start:stop])
            futures.append(engine.generate_to_store.remote([r for r in requests if r.group_index in mine],
                                                           trained_steps, evaluation, train))
            engines.append(engine)
        return [s for part in wait_for(futures, engines, what) for s in part]

    def _training_requests(self, rollout_id: int, trained_steps: list[int]) -> list[SampleRequest]:
        args, n = self.args, self.args.n_samples_per_prompt
        prompts = self.dataset.next_batch(args.rollout_batch_size)
        outputs = probed_outputs(args, self.train_plan, trained_steps) if self.train_plan is not None else {}
        shown = thumbnail_samples(len(prompts), n)
        return [SampleRequest(item.prompt, g, j, sample_seed(args.rollout_seed, rollout_id, g, j), dict(item.metadata),
                              output_steps=outputs.get(g * n + j, ()), reward_frames=frames_to_send(args, item.metadata),
                              thumbnail=g * n + j in shown)
                for g, item in enumerate(prompts) for j in range(n)]

    def generate(self, rollout_id: int) -> tuple[RolloutRefs, dict[str, float]]:
        args = self.args
        start = time.perf_counter()
        trained_steps = trained_steps_for_rollout(args, rollout_id)
        requests = self._training_requests(rollout_id, trained_steps)
        stored = self._sample(requests, trained_steps, evaluation=False, train=self.train_plan is not None)
        generated = time.perf_counter()
        rewards = self.rewards.score_stored([s.reward_input for s in stored])
        advantages = compute_advantages(torch.tensor(rewards), args.n_samples_per_prompt,
                                        globalize_mean=args.globalize_reward_mean,
                                        globalize_std=args.globalize_reward_std, adv_clip_max=args.diffusion_adv_clip_max,
                                        estimator=args.advantage_estimator)
        self._keep_thumbnails(requests, stored, rewards)
        reward_t = torch.tensor(rewards, dtype=torch.float64)
        metrics = {
            "rollout/reward/raw_mean": float(reward_t.mean()),
            "rollout/reward/raw_std": float(reward_t.std(unbiased=False)),
            "rollout/advantage_abs_mean": float(advantages.abs().mean()),
            "rollout/trained_steps": len(trained_steps),
            "perf/rollout_time": time.perf_counter() - start,
            "perf/reward_time": time.perf_counter() - generated,
        }
        batch = RolloutRefs(rollout_id, [s.trajectory for s in stored], [s.cond for s in stored], rewards,
                            advantages.tolist(), trained_steps)
        return batch, metrics

    def _keep_thumbnails(self, requests: list[SampleRequest], stored: list[StoredSample], rewards: list[float]) -> None:
        shown = [(r, s, reward) for r, s, reward in zip(requests, stored, rewards) if s.thumbnail is not None]
        self.last_images = [torch.tensor(s.thumbnail, dtype=torch.float32) / 255.0 for _, s, _ in shown]
        self.last_captions = [(r.prompt, reward) for r, _, reward in shown]

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Mean reward of deterministic (all-ODE) samples of the eval prompts, one per prompt; the
        engines keep only what the reward workers read, dropped once scored."""
        args = self.args
        items = read_prompt_file(args.eval_prompt_data or args.prompt_data, args.input_key, args.metadata_key)
        items = items[:args.eval_num_prompts] if args.eval_num_prompts else items
        requests = [SampleRequest(item.prompt, g, 0, sample_seed(args.rollout_seed, EVAL_SEED_OFFSET, g, 0),
                                  dict(item.metadata), reward_frames=frames_to_send(args, item.metadata))
                    for g, item in enumerate(items)]
        stored = self._sample(requests, [], evaluation=True, train=False, what="eval")
        rewards = self.rewards.score_stored([s.reward_input for s in stored])
        # as the engines ran them (--diffusion-eval-num-steps)
        steps = max(s.num_steps for s in stored)
        del stored  # the last references: the engines' object store frees the frames now
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

    def weight_digests(self) -> dict[str, str]:
        """The first engine's (every engine receives the same weights)."""
        return wait_for([self.engines[0].weight_digests.remote()], self.engines[:1], "weight_digests")[0]

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
