"""What the parity probe (--diffusion-debug-mode) costs a train step, checked on every micro-batch
and sampled (--diffusion-debug-probe-micro-batches 1), against the same step without it.

    nice -n 19 python3 benchmarks/bench_parity_probe.py [--rounds 5] [--size tiny|proxy] [--workdir DIR]

One rollout of an sd3 checkpoint of our own (the `tiny` proxy by default, `--size proxy` for the
larger one) with its model outputs stored, then one TrainRank per mode (same argv but for the
probe flags) trains on it, the modes alternated round by round; each step is timed in CPU time
(one torch thread), which a busy machine does not inflate; medians compared. The probe's cost is its extra no-grad forwards: one per micro-batch
after the rollout's first optimizer step (the first step's micro-batches are checked on the
forward training runs anyway). Two optimizer steps per rollout, one pair per micro-batch, so
half the micro-batches come after the first step: the every-micro-batch probe re-runs all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

FLAGS = ("--rollout-batch-size 2 --n-samples-per-prompt 4 --diffusion-num-steps 6 --diffusion-num-sde-steps 2 "
         "--rm-type brightness --device cpu --rollout-microgroup-size 1 --micro-batch-size 1 --num-steps-per-rollout 2 --num-rollout 1 "
         "--lr 1e-5 --actor-num-gpus-per-node 1 --num-gpus-per-node 2")
MODES = {"no probe": "", "probe every micro-batch": "--diffusion-debug-mode",
         "probe 1 micro-batch per rollout": "--diffusion-debug-mode --diffusion-debug-probe-micro-batches 1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each mode, after one warm-up")
    parser.add_argument("--size", choices=("tiny", "proxy"), default="tiny")
    parser.add_argument("--workdir", default=None, help="where the checkpoint and prompts go (default: a temp dir)")
    opts = parser.parse_args()

    from miles.backends.actor import TrainRank
    from miles.models.runtime import CPU_THREADS_PER_ACTOR, configure_torch
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.prompts import ensure_prompt_file
    from miles.flags.arguments import parse_and_plan

    configure_torch(False, CPU_THREADS_PER_ACTOR)
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="bench_parity_probe_"))
    checkpoint = ensure_checkpoint("sd3", opts.size, 0, work)
    prompts = ensure_prompt_file("tiny", work / "prompts.jsonl", num_prompts=8)
    side = 64 if opts.size == "tiny" else 128
    base = f"--hf-checkpoint {checkpoint} --prompt-data {prompts} {FLAGS} --diffusion-height {side} --diffusion-width {side}"
    debug_args, _ = parse_and_plan(f"{base} --run-dir {work / 'rollout'} --diffusion-debug-mode".split())
    batch = _rollout(debug_args)  # model outputs stored: what the probe compares with
    ranks = {}
    for mode, flags in MODES.items():
        args, plan = parse_and_plan(f"{base} --run-dir {work / mode.replace(' ', '_')} {flags}".split())
        ranks[mode] = TrainRank(args, plan, 0, 1)
        ranks[mode].setup()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(opts.rounds + 1):
        for mode, rank in ranks.items():
            start = time.process_time()  # CPU time of this one-thread process: what a busy machine leaves alone
            rank.train(batch)
            if round_index:  # the first round warms up
                times[mode].append(time.process_time() - start)
    base_s = statistics.median(times["no probe"])
    print(f"sd3 {opts.size}, {side} px, {len(batch.trajectories)} samples x {len(batch.trained_steps)} trained steps, "
          f"one pair per micro-batch, 2 optimizer steps per rollout; medians of {opts.rounds} rounds of CPU time")
    for mode, samples in times.items():
        median = statistics.median(samples)
        print(f"  {mode:34s} {median:7.3f} s   cost of the probe {100 * (median / base_s - 1):+6.1f} % of the step")


def _rollout(args):
    from miles.backends.loss import compute_advantages
    from miles.backends.types import RolloutBatch
    from miles.ray.rollout_manager import sample_seed
    from miles.rollout.data import PromptDataset
    from miles.rollout.engine import RolloutEngine
    from miles.rollout.step_strategy import trained_steps_for_rollout
    from miles.rollout.types import SampleRequest
    import torch

    engine = RolloutEngine.from_args(args, num_threads=1)
    items = PromptDataset.from_args(args).next_batch(args.rollout_batch_size)
    n = args.n_samples_per_prompt
    requests = [SampleRequest(item.prompt, g, j, sample_seed(args.rollout_seed, 0, g, j), dict(item.metadata))
                for g, item in enumerate(items) for j in range(n)]
    steps = trained_steps_for_rollout(args, 0)
    trajectories = engine.generate(requests, steps, True)
    rewards = [float(t.image.mean()) for t in trajectories]
    advantages = compute_advantages(torch.tensor(rewards), n)
    return RolloutBatch(0, [dataclasses.replace(t, image=None) for t in trajectories], rewards, advantages.tolist(),
                        steps)


if __name__ == "__main__":
    main()
