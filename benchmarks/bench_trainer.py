"""Training pairs per second: the Ray trainer against a plain single-process loop.

    python3 benchmarks/bench_trainer.py [--rounds 7] [--processes 3] [--workdir DIR]

Both train the same tiny sd3 model on the same rollout batch with one CPU thread: the plain loop
is velocity -> SDE log-prob -> Flow-GRPO loss -> backward -> AdamW written out in this file; the
Ray trainer is one `TrainActor` of `TrainActorGroup`, handed the batch as train_diffusion.py hands
it (the object, put and shipped by the group), timed both from the driver (round trip: the
hand-off and the result counted) and inside the actor (the training step alone). Each runs in
`--processes` processes of its own (plain: spawned, no Ray; Ray: one single-rank group each), and
every step of every process counts: the same code in two processes runs up to ~5 % apart (six
actors of one run measured 0.951-0.997 of one plain process), so one process against one other
measured which process was faster, not what Ray costs. Both forward the
rollout's tiles (a microgroup's samples at one step), so the first step's loss is the same to the
bit, which the report checks. Rounds alternate between the two, the order swapped each round, so
a busy machine slows both alike; the medians are compared. The process is pinned as a CPU run's
processes are (miles.utils.numerics), before torch loads; the actor inherits the pins through the
cluster, and runs at the priority the launcher's nodes give their workers (niceness 0, not Ray's
15: a niced actor loses the CPU to any other process and the ratio measures the machine's load).
Ray start-up (cluster, actor, model load) is reported apart. `benchmarks/bench_sampling.py` runs
the same measurement beside its own. First it prints the host syncs per optimizer step before and
after issue 41 (benchmarks/step_host_syncs.py; `--host-syncs-only` stops there).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from miles.utils.numerics import pin_this_process

pin_this_process()  # before torch loads, as in every process of a CPU run

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("--rollout-batch-size 4 --n-samples-per-prompt 8 --diffusion-height 64 --diffusion-width 64 "
         "--diffusion-num-steps 8 --diffusion-num-sde-steps 2 --rm-type color_match --device cpu "
         "--num-rollout 1 --lr 1e-4 --colocate "
         "--actor-num-gpus-per-node 1 --num-gpus-per-node 1")


def make_batch(args):
    """The tiny run's first rollout, scored, without the images (the trainer never sees them)."""
    sys.path.insert(0, str(REPO / "tests/unit/backends"))
    from dtype_helpers import one_rollout

    batch = one_rollout(args, debug=False)
    return dataclasses.replace(batch, trajectories=[dataclasses.replace(t, image=None) for t in batch.trajectories])


def rollout_tiles(plan, batch) -> list[list[tuple[int, int]]]:
    """The trainer's forwards on one rank, in its order (miles.flags.batching.rank_schedule): a
    microgroup's samples at one step; (sample, step) pairs."""
    from miles.flags.batching import rank_schedule

    return [[(pair.sample, pair.step) for pair in forward]
            for step in rank_schedule(plan, batch.trained_steps, 0) for forward in step]


class PlainLoop:
    """The same training step with nothing around it: no Ray, no plan, no metrics. It forwards the
    trainer's tiles (a different batch size would be different work) and weights each tile's loss
    by its share of the pairs the loss keeps, as the trainer does, so the first step's loss equals
    the Ray trainer's bit for bit (`measure` checks it)."""

    def __init__(self, args, plan):
        from miles.backends.optimizer import build_optimizer
        from miles.models.loader import load_model

        self.args, self.plan = args, plan
        self.model = load_model(args.hf_checkpoint)
        self.transformer = self.model.transformers["transformer"].requires_grad_(True)
        self.optimizer = build_optimizer(list(self.transformer.parameters()), args)

    def train(self, batch) -> tuple[int, float]:
        """One optimizer step over the batch's pairs: (pairs trained, the loss)."""
        from miles.backends.loss import PolicyLossInputs, policy_loss, trained_pairs_mask
        from miles.rollout.sde import largest_sigma_below_one, sde_step
        from miles.rollout.types import Conditioning

        tiles = rollout_tiles(self.plan, batch)
        keeps = [trained_pairs_mask(torch.tensor([batch.advantages[i] for i, _ in tile]), False) for tile in tiles]
        kept = sum(int(keep.sum()) for keep in keeps)
        total = 0.0
        for tile, keep in zip(tiles, keeps):
            trajs = [batch.trajectories[i] for i, _ in tile]
            k = tile[0][1]
            x = torch.stack([t.latents[k] for t in trajs])
            x_next = torch.stack([t.latents[k + 1] for t in trajs])
            sigma = torch.stack([t.sigmas[k] for t in trajs])
            sigma_next = torch.stack([t.sigmas[k + 1] for t in trajs])
            # the unconditional branch without gradient, as the trainer runs it (flow_grpo's default)
            v = self.model.velocity(x, sigma, Conditioning.cat([t.cond for t in trajs]), trajs[0].guidance_scales[k],
                                    "transformer", detach_uncond=not self.args.train_uncond_branch)
            step = sde_step(x, v, sigma, sigma_next, trajs[0].noise_level, trajs[0].sde_type, x_next=x_next,
                            sigma_max=largest_sigma_below_one(trajs[0].sigmas.tolist()))
            old = torch.stack([t.log_probs[k] for t in trajs])
            adv = torch.tensor([batch.advantages[i] for i, _ in tile])
            loss, _ = policy_loss(PolicyLossInputs(step.log_prob, old, adv, step.mean, step.std,
                                                   std_dev_t=step.std_dev_t, keep=keep),
                                  clip_range=self.args.diffusion_clip_range)
            share = int(keep.sum()) / kept if kept else 0.0
            (loss * share).backward()
            total += float(loss.detach()) * share
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), self.args.clip_grad, foreach=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum(len(tile) for tile in tiles), total


def plain_process(conn, setup: bytes) -> None:
    """A plain loop in a process of its own: one step per request, timed here, sent back with the
    pairs and the loss; None ends it. `setup` is (args, plan, batch) pickled plainly: torch's
    multiprocessing pickler would share the tensors through file descriptors."""
    import pickle

    from miles.models.runtime import CPU_THREADS_PER_ACTOR, configure_torch

    args, plan, batch = pickle.loads(setup)
    configure_torch(num_threads=CPU_THREADS_PER_ACTOR)
    loop = PlainLoop(args, plan)
    conn.send("ready")
    while conn.recv() is not None:
        gc.collect()
        start = time.perf_counter()
        pairs, loss = loop.train(batch)
        conn.send((time.perf_counter() - start, pairs, loss))


class PlainProcesses:
    """`count` plain loops, each in a spawned process (pinned as it imports this file)."""

    def __init__(self, count: int, args, plan, batch):
        import multiprocessing
        import pickle

        context = multiprocessing.get_context("spawn")
        setup = pickle.dumps((args, plan, batch))
        self.conns, self.procs = [], []
        for _ in range(count):
            ours, theirs = context.Pipe()
            proc = context.Process(target=plain_process, args=(theirs, setup), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def step(self, index: int) -> tuple[float, int, float]:
        self.conns[index].send("step")
        return self.conns[index].recv()

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            conn.send(None)
            proc.join(timeout=30)


@dataclasses.dataclass
class TrainerTimes:
    """Seconds per training step, round by round (the warm-up round left out)."""

    pairs: int
    microgroup_size: int
    plain: list[float]
    ray_round_trip: list[float]
    ray_step: list[float]  # timed inside the actor
    cluster_start: float
    actor_start: float
    first_loss: tuple[float, float] = (0.0, 0.0)  # plain, Ray: the warm-up step's, from the same weights
    put: list[float] = dataclasses.field(default_factory=list)  # ray.put of the batch (its pickling)
    batch_bytes: int = 0
    worker_niceness: int = 0  # a Ray worker's on this cluster (the plain loop runs at the shell's)
    processes: int = 1  # of each kind; every step of every process is in the lists

    def ratio(self, times: list[float]) -> float:
        """Ray rate / plain rate from the medians."""
        return statistics.median(self.plain) / statistics.median(times)


def measure(work: Path, rounds: int, processes: int = 3) -> TrainerTimes:
    """`rounds` timed rounds after a warm-up round; a round is one step of every plain process and
    every Ray trainer, the order of the legs turned from round to round (whatever runs later never
    always meets a warmer cache or a fuller heap), the garbage collected before each step."""
    import ray

    from miles.models.runtime import CPU_THREADS_PER_ACTOR, configure_torch
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.prompts import ensure_prompt_file
    from miles.ray.placement import PlacementPlan, Slot, create_placement_group
    from miles.ray.train_actor_group import TrainActorGroup
    from miles.flags.arguments import parse_and_plan
    from miles.launcher.ray_cluster import WORKER_PRIORITY_ENV

    checkpoint = ensure_checkpoint("sd3", "tiny", 0, work)
    prompts = ensure_prompt_file("tiny", work / "prompts.jsonl", num_prompts=16)
    args, plan = parse_and_plan(f"--hf-checkpoint {checkpoint} --prompt-data {prompts} {FLAGS}".split())
    configure_torch(num_threads=CPU_THREADS_PER_ACTOR)
    batch = make_batch(args)
    plain = PlainProcesses(processes, args, plan, batch)

    t0 = time.perf_counter()
    ray_temp = tempfile.mkdtemp(prefix="br", dir="/tmp")  # short: Ray's socket paths live under it
    # the actors at the priority the launcher's nodes give them; the shell's environment again after
    # the cluster started (its raylet read it then), for whatever this process starts later
    with mock.patch.dict(os.environ, WORKER_PRIORITY_ENV):
        ray.init(num_cpus=processes + 1, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp)
    t_cluster = time.perf_counter() - t0
    placement = PlacementPlan([{"CPU": 1.0}], [Slot(0, 1.0, 0.0)])
    groups = [TrainActorGroup(args, plan, placement, create_placement_group(placement)) for _ in range(processes)]
    groups = [group.wait_ready() for group in groups]
    t_actor = time.perf_counter() - t0 - t_cluster
    times = TrainerTimes(0, args.rollout_microgroup_size, [], [], [], t_cluster, t_actor, processes=processes)
    legs = [("plain", i) for i in range(processes)] + [("ray", i) for i in range(processes)]
    try:
        times.worker_niceness = ray.get(ray.remote(num_cpus=0)(niceness).remote())
        for round_index in range(rounds + 1):  # round 0 warms every process up
            turn = round_index % len(legs)
            for kind, index in legs[turn:] + legs[:turn]:
                gc.collect()
                start = time.perf_counter()
                if kind == "plain":
                    step, times.pairs, loss = plain.step(index)
                else:
                    # as the driver hands a rollout over (train_diffusion.py): the batch, not a ref put before
                    result = groups[index].train(batch)[0]
                    trip = time.perf_counter() - start
                if round_index == 0:
                    if kind == "plain" and index == 0:
                        times.first_loss = (loss, times.first_loss[1])
                    elif kind == "ray" and index == 0:
                        times.first_loss = (times.first_loss[0], result.metrics["train/loss"])
                    continue
                if kind == "plain":
                    times.plain.append(step)
                else:
                    times.ray_round_trip.append(trip)
                    times.ray_step.append(result.metrics["perf/train_time"])
        times.put, times.batch_bytes = time_put(batch, rounds)
    finally:
        plain.close()
        for group in groups:
            group.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_temp, ignore_errors=True)  # Ray leaves its session logs behind
    return times


def niceness() -> int:
    return os.nice(0)


def time_put(batch, rounds: int) -> tuple[list[float], int]:
    """The hand-off's driver side alone: `ray.put` of the batch (pickling and the store write)."""
    import pickle

    import ray

    puts = []
    for _ in range(rounds):
        start = time.perf_counter()
        ref = ray.put(batch)
        puts.append(time.perf_counter() - start)
        del ref
    return puts, len(pickle.dumps(batch, protocol=5))


def report(times: TrainerTimes) -> None:
    rate = lambda ts: times.pairs / statistics.median(ts)  # noqa: E731
    show = lambda ts: ", ".join(f"{t:.2f}s" for t in ts)  # noqa: E731
    steps = len(times.plain)
    each = f"{steps} steps: {times.processes} processes x {steps // max(times.processes, 1)} rounds"
    print(f"pairs per training step       {times.pairs} (tiny sd3, 64x64, forwards of {times.microgroup_size} samples "
          f"at one step as the rollout made them, 1 CPU thread, pinned numerics)")
    plain_loss, ray_loss = times.first_loss
    same = "the same" if plain_loss == ray_loss else "DIFFERENT: the two legs do not do the same work"
    print(f"Ray worker niceness           {times.worker_niceness} (this process: {os.nice(0)})")
    print(f"first step's loss             plain {plain_loss:.9g}, Ray {ray_loss:.9g}: {same}")
    print(f"plain single-process loop     {rate(times.plain):8.1f} pairs/s  (median of {each}: {show(times.plain)})")
    print(f"Ray trainer (1 rank)          {rate(times.ray_round_trip):8.1f} pairs/s  (median of {each}: "
          f"{show(times.ray_round_trip)})")
    print(f"  of which the training step  {rate(times.ray_step):8.1f} pairs/s  (timed inside the actor: "
          f"{show(times.ray_step)})")
    hand_off = [r - t for r, t in zip(times.ray_round_trip, times.ray_step)]
    print(f"  hand-off and return         {1e3 * statistics.median(hand_off):8.1f} ms  (round trip - step; of which "
          f"ray.put of the {times.batch_bytes / 1e6:.2f} MB batch {1e3 * statistics.median(times.put):.1f} ms)")
    print(f"ratio Ray / plain, round trip {times.ratio(times.ray_round_trip):8.3f}  (target >= 0.95)")
    print(f"ratio Ray / plain, train step {times.ratio(times.ray_step):8.3f}  (target >= 0.95)")
    print(f"Ray start-up, not in the rate {times.cluster_start:8.1f}s cluster + {times.actor_start:.1f}s train actor "
          f"(model load)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (a step of every process), after one warm-up round")
    parser.add_argument("--processes", type=int, default=3, help="processes of each kind (plain loops, Ray trainers)")
    parser.add_argument("--workdir", default=None, help="where the tiny checkpoint and prompts go (default: a temp dir)")
    parser.add_argument("--host-syncs-only", action="store_true",
                        help="only the host syncs per step, before and after issue 41 (benchmarks/step_host_syncs.py)")
    opts = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_host_syncs import report as host_syncs_report

    host_syncs_report()  # counts, not timings: the machine's load does not move them
    if opts.host_syncs_only:
        return
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(measure(Path(opts.workdir or tempfile.mkdtemp(prefix="bench_trainer_")), opts.rounds, opts.processes))
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
