#!/usr/bin/env python3
"""How close the suite runner's packing gets to the lower bound, against a naive split.

For random suites (default 40 tests on an 8-GPU node, GPU counts from 1, 2, 4, 5, 8, times
60-1800 s) it prints the packed makespan over the lower bound max(sum(gpus x time) / GPUs,
longest test), beside the makespan of splitting the same suite by time alone across two fixed
4-GPU runners, each running its share one test at a time. A test wider than 4 GPUs fits neither
runner; the split charges those as a phase in which both runners join into the whole node.

    python3 benchmarks/bench_suite_packing.py [--suites 100] [--tests 40] [--gpus 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ci.scheduler import Job, lower_bound, make_plan, plan_problems, wide_job_bound  # noqa: E402

GPU_COUNTS = [1, 2, 4, 5, 8]
MIXES = {
    # a nightly suite: mostly small tests, a few that need most of the node
    "nightly-like (35/25/20/10/10 %)": [35, 25, 20, 10, 10],
    "uniform over 1,2,4,5,8": None,
}


def random_suite(rng: random.Random, size: int, weights) -> list[Job]:
    return [Job(f"t{i}", rng.choices(GPU_COUNTS, weights)[0], rng.randint(60, 1800))
            for i in range(size)]


def split_by_time(jobs: list[Job], runners: int = 2, runner_gpus: int = 4) -> float:
    """Longest test first onto the runner with the least queued time; GPU counts ignored."""
    loads = [0.0] * runners
    fits = [j for j in jobs if j.gpus <= runner_gpus]
    for job in sorted(fits, key=lambda j: -j.est_time):
        loads[loads.index(min(loads))] += job.est_time
    joined_phase = sum(j.est_time for j in jobs if j.gpus > runner_gpus)
    return max(loads) + joined_phase


def measure(jobs: list[Job], num_gpus: int, iterations: int) -> dict:
    started = time.perf_counter()
    plan = make_plan(jobs, range(num_gpus), iterations=iterations)
    seconds = time.perf_counter() - started
    problems = plan_problems(plan.as_json(), jobs, range(num_gpus))
    if problems:
        raise SystemExit(f"invalid plan: {problems[:3]}")
    bound = lower_bound(jobs, num_gpus)
    return {
        "makespan": plan.makespan,
        "ratio": plan.makespan / bound,
        "ratio_wide": plan.makespan / wide_job_bound(jobs, num_gpus),
        "bound_gap": wide_job_bound(jobs, num_gpus) / bound,
        "split": split_by_time(jobs),
        "split_ratio": split_by_time(jobs) / bound,
        "plan_seconds": seconds,
    }


def report(name: str, rows: list[dict]) -> None:
    def mean(key):
        return statistics.mean(r[key] for r in rows)

    def worst(key):
        return max(r[key] for r in rows)

    print(f"\n{name}: {len(rows)} suites")
    print(f"  packed makespan / lower bound      mean {mean('ratio'):.4f}  max {worst('ratio'):.4f}"
          f"  (within 3%: {mean('ratio') <= 1.03}, every suite within 10%: {worst('ratio') <= 1.10})")
    print(f"  packed makespan / wide-job bound   mean {mean('ratio_wide'):.4f}  max {worst('ratio_wide'):.4f}"
          "  (no plan can beat this bound)")
    out_of_reach = sum(r["bound_gap"] > 1.10 for r in rows)
    print(f"  suites no plan can pack within 10% of the lower bound: {out_of_reach}"
          f" (wide-job bound / lower bound: mean {mean('bound_gap'):.4f}, max {worst('bound_gap'):.4f})")
    print(f"  split by time, 2 x 4-GPU / bound   mean {mean('split_ratio'):.4f}  max {worst('split_ratio'):.4f}")
    print(f"  mean makespan: packed {mean('makespan') / 3600:.2f} h, split {mean('split') / 3600:.2f} h"
          f" ({mean('split') / mean('makespan'):.2f}x longer)")
    print(f"  planning time per suite            mean {mean('plan_seconds'):.3f}s  max {worst('plan_seconds'):.3f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", type=int, default=100)
    p.add_argument("--tests", type=int, default=40)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--iterations", type=int, default=1500, help="local-search steps per plan")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name, weights in MIXES.items():
        rng = random.Random(args.seed)
        rows = [measure(random_suite(rng, args.tests, weights), args.gpus, args.iterations)
                for _ in range(args.suites)]
        report(name, rows)
        print(f"  {'suite':>5} {'packed':>8} {'bound':>8} {'ratio':>7} {'split':>8} {'ratio':>7}")
        for i, row in enumerate(rows[:5]):
            bound = row["makespan"] / row["ratio"]
            print(f"  {i:>5} {row['makespan']:8.0f} {bound:8.0f} {row['ratio']:7.4f} "
                  f"{row['split']:8.0f} {row['split_ratio']:7.4f}")


if __name__ == "__main__":
    main()
