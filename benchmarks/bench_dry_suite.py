#!/usr/bin/env python3
"""Wall time of the whole dry suite, and where the time of one CPU-tier run goes.

1. Runs `pytest tests/e2e -m dry` (every recipe's dry check: subprocess with submission off,
   in-process validation, snapshot compare) and prints its wall time, serially and with
   `-n 2`. Target: under 5 s for the catalog.
2. Runs one CPU-tier case for real through the harness (default: the tiny CPU recipe, two
   rollouts) and prints its wall time, the time inside the training loop (the sum of the
   trainer's perf/step_time) and the share of wall time spent outside the loop (Ray start,
   imports, checkpoint creation, actor start-up, teardown).

    python3 benchmarks/bench_dry_suite.py [--repeat 3] [--case tests/e2e/test_grpo_tiny_cpu.py] [--no-cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def time_dry_suite(extra: list[str], repeat: int) -> tuple[list[float], int]:
    cmd = [sys.executable, "-m", "pytest", "tests/e2e", "-m", "dry", "-q", "-p", "no:cacheprovider", *extra]
    walls, count = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-2000:])
            raise SystemExit(f"dry suite failed: {' '.join(cmd)}")
        for line in proc.stdout.splitlines():
            if " passed" in line:
                count = int(line.strip("= ").split()[0])
    return walls, count


def load_case(path: Path, tier: str = "cpu"):
    spec = importlib.util.spec_from_file_location("bench_case_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (case,) = [c for c in module.CASES if c.tier == tier]
    return case


def time_cpu_case(case_file: Path) -> None:
    from miles.testing.runner import run_recipe

    case = load_case(case_file)
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        models = Path(os.environ.get("MILES_TEST_MODEL_DIR") or Path(tmp) / "models")
        run = run_recipe(case, Path(tmp) / "run", rootdir=REPO, env={"MILES_SCRIPT_MODEL_DIR": str(models)})
        if not run.ok:
            print(run.report(tail_lines=40))
            raise SystemExit("CPU case failed")
        inside = run.training_time()
        perf = run.perf
        rollout = sum(r.get("perf/rollout_time", 0.0) for r in perf)
        train = sum(r.get("perf/train_time", 0.0) for r in perf)
        outside = run.wall_time - inside
        print(f"\nCPU-tier case {case.name} ({' '.join(case.args)}):")
        print(f"  wall time                  {run.wall_time:8.1f} s")
        print(f"  inside the training loop   {inside:8.1f} s  (rollout {rollout:.1f} s, train {train:.1f} s, "
              f"{len(perf)} rollouts)")
        print(f"  outside the training loop  {outside:8.1f} s  = {outside / run.wall_time:.1%} of wall time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", type=Path, default=REPO / "tests" / "e2e" / "test_grpo_tiny_cpu.py",
                    help="case list whose CPU-tier case is timed")
    ap.add_argument("--no-cpu", action="store_true", help="only the dry suite")
    args = ap.parse_args()

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for label, extra in (("serial", []), ("-n 2", ["-n", "2"])):
        walls, count = time_dry_suite(extra, args.repeat)
        print(f"dry suite ({count} recipes, {label}): wall {min(walls):.2f} s best, "
              f"{statistics.median(walls):.2f} s median of {len(walls)}  (target < 5 s)")
    if not args.no_cpu:
        time_cpu_case(args.case)


if __name__ == "__main__":
    main()
