"""Training pairs per second: the Ray trainer against a plain single-process loop.

    python3 benchmarks/bench_trainer.py [--rounds 3] [--workdir DIR]

Both train the same tiny sd3 model on the same rollout batch with one CPU thread: the plain loop
is velocity -> SDE log-prob -> Flow-GRPO loss -> backward -> AdamW written out in this file; the
Ray trainer is one `TrainActor` of `TrainActorGroup`, timed both from the driver (round trip:
the batch hand-off to the actor counted) and inside the actor (the training step alone). Rounds alternate between the two so a busy machine slows both
alike; the medians are compared. Ray start-up (cluster, actor, model load) is reported apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("--rollout-batch-size 4 --n-samples-per-prompt 8 --diffusion-height 64 --diffusion-width 64 "
         "--diffusion-num-steps 8 --diffusion-num-sde-steps 2 --rm-type color_match --device cpu "
         "--num-rollout 1 --lr 1e-4 --colocate "
         "--actor-num-gpus-per-node 1 --num-gpus-per-node 1")


def make_batch(args):
    """The tiny run's first rollout, scored, without the images (the trainer never sees them)."""
    sys.path.insert(0, str(REPO / "tests/unit/backends"))
    from dtype_helpers import one_rollout

    from miles.ray.rollout_manager import without_images

    batch = one_rollout(args, debug=False)
    return dataclasses.replace(batch, trajectories=without_images(batch.trajectories))


class PlainLoop:
    """The same training step with nothing around it: no Ray, no plan, no metrics."""

    def __init__(self, args):
        from miles.models.loader import load_model

        self.args = args
        self.model = load_model(args.hf_checkpoint)
        self.transformer = self.model.transformers["transformer"].requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=args.lr, foreach=False)

    def train(self, batch) -> int:
        from miles.backends.loss import PolicyLossInputs, policy_loss
        from miles.rollout.sde import largest_sigma_below_one, sde_step
        from miles.rollout.types import Conditioning

        pairs = [(i, k) for i in range(len(batch.trajectories)) for k in batch.trained_steps]
        size = self.args.micro_batch_size
        for start in range(0, len(pairs), size):
            chunk = pairs[start:start + size]
            trajs = [batch.trajectories[i] for i, _ in chunk]
            x = torch.stack([t.latents[k] for t, (_, k) in zip(trajs, chunk)])
            x_next = torch.stack([t.latents[k + 1] for t, (_, k) in zip(trajs, chunk)])
            sigma = torch.stack([t.sigmas[k] for t, (_, k) in zip(trajs, chunk)])
            sigma_next = torch.stack([t.sigmas[k + 1] for t, (_, k) in zip(trajs, chunk)])
            v = self.model.velocity(x, sigma, Conditioning.cat([t.cond for t in trajs]),
                                    trajs[0].guidance_scales[chunk[0][1]], "transformer")
            step = sde_step(x, v, sigma, sigma_next, trajs[0].noise_level, trajs[0].sde_type, x_next=x_next,
                            sigma_max=largest_sigma_below_one(trajs[0].sigmas.tolist()))
            old = torch.stack([t.log_probs[k] for t, (_, k) in zip(trajs, chunk)])
            adv = torch.tensor([batch.advantages[i] for i, _ in chunk])
            loss, _ = policy_loss(PolicyLossInputs(step.log_prob, old, adv, step.mean, step.std),
                                  clip_range=self.args.diffusion_clip_range)
            (loss * len(chunk) / len(pairs)).backward()
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), self.args.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each, after one warm-up")
    parser.add_argument("--workdir", default=None, help="where the tiny checkpoint and prompts go (default: a temp dir)")
    opts = parser.parse_args()

    import ray

    from miles.models.runtime import CPU_THREADS_PER_ACTOR
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.models.runtime import configure_torch
    from miles.ray.placement import PlacementPlan, Slot, create_placement_group
    from miles.ray.train_actor_group import TrainActorGroup
    from miles.proxy_assets.prompts import ensure_prompt_file
    from miles.utils.arguments import parse_and_plan

    work = Path(opts.workdir or tempfile.mkdtemp(prefix="bench_trainer_"))
    checkpoint = ensure_checkpoint("sd3", "tiny", 0, work)
    prompts = ensure_prompt_file("tiny", work / "prompts.jsonl", num_prompts=16)
    args, plan = parse_and_plan(f"--hf-checkpoint {checkpoint} --prompt-data {prompts} {FLAGS}".split())
    configure_torch(num_threads=CPU_THREADS_PER_ACTOR)
    batch = make_batch(args)
    plain = PlainLoop(args)

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="br", dir="/tmp"))
    t_cluster = time.perf_counter() - t0
    placement = PlacementPlan([{"CPU": 1.0}], [Slot(0, 1.0, 0.0)])
    pg = create_placement_group(placement)
    group = TrainActorGroup(args, plan, placement, pg).wait_ready()
    t_actor = time.perf_counter() - t0 - t_cluster
    batch_ref = ray.put(batch)

    plain_times, ray_times, actor_times = [], [], []
    for round_index in range(opts.rounds + 1):  # round 0 warms both up
        start = time.perf_counter()
        pairs = plain.train(batch)
        plain_time = time.perf_counter() - start
        start = time.perf_counter()
        result = group.train(batch_ref)[0]
        ray_time = time.perf_counter() - start
        if round_index:
            plain_times.append(plain_time)
            ray_times.append(ray_time)
            actor_times.append(result.metrics["perf/train_time"])
    group.shutdown()
    ray.shutdown()

    plain_rate = pairs / statistics.median(plain_times)
    ray_rate = pairs / statistics.median(ray_times)
    step_rate = pairs / statistics.median(actor_times)
    print(f"pairs per training step       {pairs} (tiny sd3, 64x64, micro-batch {args.micro_batch_size}, 1 CPU thread)")
    print(f"plain single-process loop     {plain_rate:8.1f} pairs/s  (median of {opts.rounds}: "
          f"{', '.join(f'{t:.2f}s' for t in plain_times)})")
    print(f"Ray trainer (1 rank)          {ray_rate:8.1f} pairs/s  (median of {opts.rounds}: "
          f"{', '.join(f'{t:.2f}s' for t in ray_times)})")
    print(f"  of which the training step  {step_rate:8.1f} pairs/s  (timed inside the actor: "
          f"{', '.join(f'{t:.2f}s' for t in actor_times)})")
    print(f"ratio Ray / plain, round trip {ray_rate / plain_rate:8.3f}")
    print(f"ratio Ray / plain, train step {step_rate / plain_rate:8.3f}  (target >= 0.9)")
    print(f"Ray start-up, not in the rate {t_cluster:8.1f}s cluster + {t_actor:.1f}s train actor (model load)")


if __name__ == "__main__":
    main()
