#!/usr/bin/env python3
"""Where the test suite's time goes: the README's test command and one CPU-tier case, phase by
phase, for this tree and (optionally) an earlier commit, measured in one run.

    python3 benchmarks/bench_test_suite.py                  # this tree: one case + the whole suite
    python3 benchmarks/bench_test_suite.py --ref HEAD~5     # ... and the same for that commit, first
    python3 benchmarks/bench_test_suite.py --no-suite       # the single case only (a minute or two)
    python3 benchmarks/bench_test_suite.py --all-cases --unit --no-suite   # every CPU-tier case alone
                                                            # (their median) and the unit tests alone

For each tree it prints:
- one CPU-tier case run alone (default: the NFT sd3 proxy, which runs on the shared cluster, and
  the tiny recipe, which starts its own head): wall time and the phases the run marked
  (miles.records.phases: recipe start-up, preparation, Ray head start, job submission, driver
  imports, actors' start-up and imports, training loop, teardown);
- the README's test command (`pytest -n 2`): wall time, the sum of unit and e2e test times,
  every real run's phases and their totals over the suite, and the ten slowest unit tests;
- with --all-cases, every CPU-tier case run alone, one after the other, and the median of their
  own wall times (the case's run, without pytest's and the shared cluster's start); the cases of
  one tree share a checkpoint cache, so only the first case of a family builds its checkpoint
  (its preparation phase shows it);
- with --unit, `pytest tests/unit -n 2` alone.
An earlier commit is checked out with `git worktree` into a temp dir (removed afterwards) and
measured with the same interpreter and packages. The load average is printed with each result:
compare runs made on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ("run_diffusion_nft_sd3_pickscore-cpu", "run_diffusion_grpo_tiny_cpu-cpu")


def pytest(tree: Path, args: list[str], results: Path, env: dict[str, str] | None = None) -> tuple[float, int, Path]:
    junit = results / "junit.xml"
    env = {**os.environ, "MILES_RESULTS_DIR": str(results / "records"), **(env or {})}
    if tree.resolve() != REPO:
        # the installed package is this checkout's; an earlier commit's tree goes first on the path
        # (its dry snapshots then fail: they record the launcher's PYTHONPATH, which it prepends to)
        env["PYTHONPATH"] = str(tree)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", f"--junitxml={junit}",
                           "-q"], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (results / "pytest.log").write_text(proc.stdout + proc.stderr)
    return wall, proc.returncode, junit


def test_times(junit: Path) -> list[tuple[str, float]]:
    if not junit.is_file():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        rows.append((f"{case.get('classname')}::{case.get('name')}", float(case.get("time") or 0.0)))
    return rows


def read_records(records: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(records.glob("*.json"))]


def print_records(records: Path) -> None:
    for record in read_records(records):
        print(f"  {record['name']}: {record['outcome']}, wall {record['wall_time']:.1f}s")
        for label, seconds in record.get("phases") or []:
            print(f"      {label:55s} {seconds:7.1f}s")


def print_phase_totals(records: Path) -> None:
    """Each phase summed over every real run: where the suite's real runs spend their time."""
    totals: dict[str, float] = {}
    runs = read_records(records)
    for record in runs:
        for label, seconds in record.get("phases") or []:
            if not label.startswith(" ") and not label.startswith("total"):
                totals[label] = totals.get(label, 0.0) + seconds
    print(f"phases summed over the suite's {len(runs)} real runs:")
    for label, seconds in totals.items():
        print(f"      {label:55s} {seconds:7.1f}s")


def cpu_tier_cases(tree: Path) -> list[str]:
    """The CPU-tier e2e cases' node ids (run_...-cpu, variants too): each selects exactly one case."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/e2e", "-m", "not dry and not nightly",
                           "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return [line for line in proc.stdout.splitlines() if line.endswith("]") and "-cpu" in line]


def case_name(selector: str) -> str:
    """`run_x-cpu` of a node id `tests/e2e/test_x.py::test_recipe[run_x-cpu]`, or the -k name itself."""
    return selector[selector.index("[") + 1:-1] if selector.endswith("]") else selector


def measure_cases_alone(tree: Path, cases: list[str], out: Path, model_dir: Path) -> list[float]:
    walls = []
    for selector in cases:
        case = case_name(selector)
        results = out / case
        results.mkdir(parents=True)
        load = os.getloadavg()[0]
        select = [selector] if selector.endswith("]") else ["tests/e2e", "-k", selector]
        wall, rc, _ = pytest(tree, [*select, "-m", "not dry and not nightly"], results,
                             env={"MILES_TEST_MODEL_DIR": str(model_dir)})
        print(f"one case alone: {case}: {wall:.1f}s (exit {rc}, load average before {load:.2f})")
        print_records(results / "records")
        walls += [r["wall_time"] for r in read_records(results / "records") if r["name"] == case]
    return walls


def measure_tree(tree: Path, label: str, opts) -> None:
    out = Path(tempfile.mkdtemp(prefix="bench_suite_"))
    print(f"\n=== {label} ({tree}) ===")
    cases = cpu_tier_cases(tree) if opts.all_cases else opts.case
    walls = measure_cases_alone(tree, cases, out / "cases", out / "models")
    if opts.all_cases and walls:
        print(f"CPU-tier cases alone: median {statistics.median(walls):.1f}s over {len(walls)} cases "
              f"(min {min(walls):.1f}s, max {max(walls):.1f}s)")
    if opts.unit:
        results = out / "unit"
        results.mkdir()
        load = os.getloadavg()[0]
        wall, rc, junit = pytest(tree, ["tests/unit", "-n", "2"], results)
        print(f"unit tests alone (pytest tests/unit -n 2): {wall:.1f}s wall, exit {rc}, load average before "
              f"{load:.2f}; {len(test_times(junit))} tests")
    if opts.no_suite:
        return
    results = out / "suite"
    results.mkdir()
    load = os.getloadavg()[0]
    wall, rc, junit = pytest(tree, ["-n", "2"], results)
    times = test_times(junit)
    unit = [t for t in times if t[0].startswith("tests.unit")]
    e2e = [t for t in times if t[0].startswith("tests.e2e")]
    print(f"README test command (pytest -n 2): {wall:.1f}s wall, exit {rc}, load average before {load:.2f}; "
          f"{len(times)} tests; sum of test times: unit {sum(t for _, t in unit):.0f}s, e2e "
          f"{sum(t for _, t in e2e):.0f}s")
    print("real runs of the suite:")
    print_records(results / "records")
    print_phase_totals(results / "records")
    print("ten slowest unit tests:")
    for name, seconds in sorted(unit, key=lambda t: -t[1])[:10]:
        print(f"  {seconds:7.1f}s  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", help="also measure this commit (before), in a temporary git worktree")
    parser.add_argument("--case", action="append", help=f"CPU-tier case name(s) to time alone (default {DEFAULT_CASES})")
    parser.add_argument("--no-suite", action="store_true", help="skip the whole-suite measurement")
    parser.add_argument("--all-cases", action="store_true",
                        help="time every CPU-tier case alone (instead of --case) and print their median")
    parser.add_argument("--unit", action="store_true", help="also time the unit tests alone (pytest tests/unit -n 2)")
    opts = parser.parse_args()
    opts.case = opts.case or list(DEFAULT_CASES)
    if opts.ref:
        worktree = Path(tempfile.mkdtemp(prefix="bench_ref_")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), opts.ref], cwd=REPO, check=True,
                       capture_output=True)
        try:
            measure_tree(worktree, f"before: {opts.ref}", opts)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
            shutil.rmtree(worktree.parent, ignore_errors=True)
    measure_tree(REPO, "after: this tree", opts)


if __name__ == "__main__":
    main()
