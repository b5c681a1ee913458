"""Training pairs per second: the Ray trainer against a plain single-process loop.

    python3 benchmarks/bench_trainer.py [--rounds 5] [--workdir DIR]

Both train the same tiny sd3 model on the same rollout batch with one CPU thread: the plain loop
is velocity -> SDE log-prob -> Flow-GRPO loss -> backward -> AdamW written out in this file; the
Ray trainer is one `TrainActor` of `TrainActorGroup`, handed the batch as train_diffusion.py hands
it (the object, put and shipped by the group), timed both from the driver (round trip: the
hand-off and the result counted) and inside the actor (the training step alone). Rounds alternate
between the two so a busy machine slows both alike; the medians are compared. Ray start-up
(cluster, actor, model load) is reported apart. `benchmarks/bench_sampling.py` runs the same
measurement beside its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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
            # the unconditional branch without gradient, as the trainer runs it (flow_grpo's default)
            v = self.model.velocity(x, sigma, Conditioning.cat([t.cond for t in trajs]),
                                    trajs[0].guidance_scales[chunk[0][1]], "transformer",
                                    detach_uncond=not self.args.train_uncond_branch)
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


@dataclasses.dataclass
class TrainerTimes:
    """Seconds per training step, round by round (the warm-up round left out)."""

    pairs: int
    micro_batch_size: int
    plain: list[float]
    ray_round_trip: list[float]
    ray_step: list[float]  # timed inside the actor
    cluster_start: float
    actor_start: float

    def ratio(self, times: list[float]) -> float:
        """Ray rate / plain rate from the medians."""
        return statistics.median(self.plain) / statistics.median(times)


def measure(work: Path, rounds: int) -> TrainerTimes:
    """`rounds` timed rounds of the plain loop and the Ray trainer, alternating, after a warm-up."""
    import ray

    from miles.models.runtime import CPU_THREADS_PER_ACTOR, configure_torch
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.prompts import ensure_prompt_file
    from miles.ray.placement import PlacementPlan, Slot, create_placement_group
    from miles.ray.train_actor_group import TrainActorGroup
    from miles.utils.arguments import parse_and_plan

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
    # as the driver hands a rollout over (train_diffusion.py): the batch itself, not a ref put beforehand
    times = TrainerTimes(0, args.micro_batch_size, [], [], [], t_cluster, t_actor)
    try:
        for round_index in range(rounds + 1):  # round 0 warms both up
            start = time.perf_counter()
            times.pairs = plain.train(batch)
            plain_time = time.perf_counter() - start
            start = time.perf_counter()
            result = group.train(batch)[0]
            ray_time = time.perf_counter() - start
            if round_index:
                times.plain.append(plain_time)
                times.ray_round_trip.append(ray_time)
                times.ray_step.append(result.metrics["perf/train_time"])
    finally:
        group.shutdown()
        ray.shutdown()
    return times


def report(times: TrainerTimes) -> None:
    rate = lambda ts: times.pairs / statistics.median(ts)  # noqa: E731
    show = lambda ts: ", ".join(f"{t:.2f}s" for t in ts)  # noqa: E731
    rounds = len(times.plain)
    print(f"pairs per training step       {times.pairs} (tiny sd3, 64x64, micro-batch {times.micro_batch_size}, "
          f"1 CPU thread)")
    print(f"plain single-process loop     {rate(times.plain):8.1f} pairs/s  (median of {rounds}: {show(times.plain)})")
    print(f"Ray trainer (1 rank)          {rate(times.ray_round_trip):8.1f} pairs/s  (median of {rounds}: "
          f"{show(times.ray_round_trip)})")
    print(f"  of which the training step  {rate(times.ray_step):8.1f} pairs/s  (timed inside the actor: "
          f"{show(times.ray_step)})")
    print(f"ratio Ray / plain, round trip {times.ratio(times.ray_round_trip):8.3f}  (target >= 0.95)")
    print(f"ratio Ray / plain, train step {times.ratio(times.ray_step):8.3f}  (target >= 0.95)")
    print(f"Ray start-up, not in the rate {times.cluster_start:8.1f}s cluster + {times.actor_start:.1f}s train actor "
          f"(model load)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each, after one warm-up")
    parser.add_argument("--workdir", default=None, help="where the tiny checkpoint and prompts go (default: a temp dir)")
    opts = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    report(measure(Path(opts.workdir or tempfile.mkdtemp(prefix="bench_trainer_")), opts.rounds))
    print(f"load average after:  {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
