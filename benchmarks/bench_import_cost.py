"""What pausing the cyclic garbage collector through the model libraries' imports saves
(miles/utils/import_cost.py): the CPU time of a process that loads a tiny checkpoint, as each
engine and train rank of a run does first.

    python3 benchmarks/bench_import_cost.py [--rounds 5] [--family wan2_2] [--workdir DIR]

Each measurement is a fresh process that imports torch, then loads the checkpoint
(`miles.models.loader.load_model`: diffusers, transformers and, through them, torch._dynamo and
sympy are imported there), timing the load in CPU seconds. Two variants, alternated round by
round so a busy machine slows them alike; medians compared:

- paused: the code as it is;
- collector on: the same process with `collector_paused` replaced by a no-op before anything
  imports it, as the code was before.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import contextlib, sys, time
if sys.argv[2] == "on":
    import miles.utils.import_cost as cost

    @contextlib.contextmanager
    def collector_left_on():
        yield

    cost.collector_paused = collector_left_on
import torch
start = time.process_time()
from miles.models.loader import load_model
load_model(sys.argv[1])
print(time.process_time() - start)
"""


def measure(checkpoint: Path, variant: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), variant], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="CPU time of loading a model with and without the "
                                                 "collector paused through the imports.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--family", default="wan2_2", help="the tiny checkpoint's family (wan2_2 builds in seconds)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the tiny checkpoint is built (default: a temp dir)")
    args = parser.parse_args()

    from miles.proxy_assets.checkpoint import ensure_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = ensure_checkpoint(args.family, "tiny", 0, args.workdir or Path(tmp))
        times: dict[str, list[float]] = {"paused": [], "on": []}
        for _ in range(args.rounds):
            for variant in times:
                times[variant].append(measure(checkpoint, variant))
    paused, on = statistics.median(times["paused"]), statistics.median(times["on"])
    print(f"loading a tiny {args.family} checkpoint after torch, CPU-s (median of {args.rounds} fresh processes):")
    print(f"  collector on     {on:.2f}   ({', '.join(f'{t:.2f}' for t in times['on'])})")
    print(f"  collector paused {paused:.2f}   ({', '.join(f'{t:.2f}' for t in times['paused'])})")
    print(f"  paused / on      {paused / on:.2f}   (saved {on - paused:.2f} CPU-s a process)")


if __name__ == "__main__":
    main()
