"""What pinned CPU numerics cost (miles/utils/numerics.py): the tiny recipe's compute, pinned
against the libraries' own choices.

    python3 benchmarks/bench_numerics_pinning.py [--rounds 3] [--workdir DIR]

Each measurement is a fresh process (the settings are read when torch loads) doing one rollout
of the tiny recipe's shape (tiny sd3, 64 px, 4 prompts x 8 samples, 8 steps, brightness
reward) and one training step on it, timed apart. Three environments, alternated round by round
so a busy machine slows them alike; medians compared:

- pinned: what every run gets (AVX2 kernels, MKL CBWR, one thread);
- native, 1 thread: the kernels the CPU offers (AVX-512 here), one thread, as the recipe's
  actors ran before the pinning (each actor already used one thread);
- native, default threads: the libraries' defaults outright (every core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("--rollout-batch-size 4 --n-samples-per-prompt 8 --diffusion-height 64 --diffusion-width 64 "
         "--diffusion-num-steps 8 --diffusion-num-sde-steps 2 --rm-type brightness --device cpu "
         "--num-rollout 1 --lr 1e-4 --colocate "
         "--actor-num-gpus-per-node 1 --num-gpus-per-node 1")
MODES = ("pinned", "native-1-thread", "native-default-threads")


def child(mode: str, workdir: Path) -> None:
    if mode == "pinned":
        from miles.utils.numerics import pin_this_process

        pin_this_process()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch

    from bench_trainer import PlainLoop, make_batch
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.prompts import ensure_prompt_file
    from miles.flags.arguments import parse_and_plan

    checkpoint = ensure_checkpoint("sd3", "tiny", 0, workdir)
    prompts = ensure_prompt_file("tiny", workdir / "prompts.jsonl", num_prompts=16)
    args, _ = parse_and_plan(f"--hf-checkpoint {checkpoint} --prompt-data {prompts} {FLAGS}".split())
    start = time.perf_counter()
    batch = make_batch(args)
    rollout = time.perf_counter() - start
    loop = PlainLoop(args)
    loop.train(batch)  # warm-up
    start = time.perf_counter()
    loop.train(batch)
    train = time.perf_counter() - start
    print(json.dumps({"mode": mode, "rollout": rollout, "train": train, "threads": torch.get_num_threads(),
                      "capability": torch.backends.cpu.get_cpu_capability()}))


def child_env(mode: str) -> dict[str, str]:
    from miles.utils.numerics import PINNED_ENV

    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    env["PYTHONPATH"] = str(REPO)
    if mode == "native-1-thread":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    return env


def measure(mode: str, workdir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--workdir", str(workdir)],
                         env=child_env(mode), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="tiny checkpoint and prompts (default: a temp dir)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="bench_pin_"))
    if opts.child:
        child(opts.child, workdir)
        return
    measure("pinned", workdir)  # builds the checkpoint once, outside the timings
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(opts.rounds):
        for mode in MODES:
            results[mode].append(measure(mode, workdir))
    load = os.getloadavg()[0]
    print(f"tiny recipe shape, {opts.rounds} rounds per environment, load average {load:.2f}, {os.cpu_count()} cores")
    medians = {}
    for mode in MODES:
        rows = results[mode]
        medians[mode] = {k: statistics.median(r[k] for r in rows) for k in ("rollout", "train")}
        print(f"{mode:24s} rollout {medians[mode]['rollout']:6.2f}s  train step {medians[mode]['train']:6.2f}s  "
              f"(torch {rows[0]['capability']}, {rows[0]['threads']} thread(s))")
    for other in MODES[1:]:
        for part in ("rollout", "train"):
            ratio = medians["pinned"][part] / medians[other][part]
            print(f"ratio pinned / {other:24s} {part:8s} {ratio:6.3f}")


if __name__ == "__main__":
    main()
