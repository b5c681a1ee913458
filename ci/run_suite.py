#!/usr/bin/env python3
"""Runs a suite of recipe test cases on one node, packing them onto its GPUs.

    python3 ci/run_suite.py --suite nightly --tier gpu --history-db ~/.cache/miles-ci/history.sqlite
    python3 ci/run_suite.py --suite-json suite.json --gpus 8 --plan

See docs/ci.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this file's directory is on sys.path instead of the repository root
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ci.cases import Case, CollectError, Selection, collect_cases, load_cases, select  # noqa: E402
from ci.history import History, load_thresholds  # noqa: E402
from ci.junit import write_junit  # noqa: E402
from ci.runner import DEFAULT_GPU_WAIT, RunSettings, SuiteRunner  # noqa: E402
from ci.scheduler import Plan, make_plan, wide_job_bound  # noqa: E402
from ci.summary import RunFacts, duration, render, write_summary  # noqa: E402

DEFAULT_THRESHOLDS = REPO / "ci" / "thresholds.yaml"
USAGE_ERROR = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", help="run the cases whose suites include NAME")
    p.add_argument("--tier", action="append", default=[], choices=["dry", "cpu", "gpu"],
                   help="keep only these tiers (repeatable)")
    p.add_argument("--label", action="append", default=[],
                   help="keep only cases carrying this label (repeatable; all must match)")
    p.add_argument("--case", action="append", default=[], dest="cases",
                   help="keep only the case of this name (repeatable), e.g. to rerun one")
    p.add_argument("--suite-json", type=Path,
                   help='take cases from this file ([{"name", "gpus", "est_time", ...}]) '
                        "instead of collecting them from the harness")
    p.add_argument("--tests", default="tests/e2e", help="where the harness's cases live")
    p.add_argument("--gpus", type=int, help="node size (default: CUDA_VISIBLE_DEVICES, else NVML)")
    p.add_argument("--cpu-jobs", type=int, default=2, help="CPU-only cases run at once")
    p.add_argument("--plan", action="store_true", help="print the schedule, run nothing")
    p.add_argument("--plan-json", type=Path, help="write the schedule as JSON")
    p.add_argument("--out", type=Path, help="logs, results, JUnit and summary (default logs/ci/...)")
    p.add_argument("--junit", type=Path, help="JUnit XML path (default OUT/junit.xml)")
    p.add_argument("--summary", type=Path, help="Markdown summary path (default OUT/summary.md)")
    p.add_argument("--history-db", type=Path, help="SQLite history for the speed and memory gate")
    p.add_argument("--thresholds", type=Path, default=DEFAULT_THRESHOLDS,
                   help="gate thresholds, defaults and per test (YAML)")
    p.add_argument("--search-iterations", type=int, default=1500,
                   help="local-search steps spent improving the packing")
    p.add_argument("--gpu-wait", type=float, default=DEFAULT_GPU_WAIT,
                   help="seconds a GPU case's lease may wait for its GPUs to show free (0: off)")
    p.add_argument("--workdir", type=Path, default=REPO, help="where pytest runs")
    p.add_argument("pytest_args", nargs="*", help="passed to every case's pytest (after --)")
    return p.parse_args(argv)


def visible_gpu_labels(requested: int | None) -> list[str]:
    """The pool: CUDA_VISIBLE_DEVICES when set (as the harness's lease reads it), else NVML.
    --gpus N takes the first N of those, or GPUs 0..N-1 when fewer are visible (planning)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        labels = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        labels = [str(i) for i in range(nvml_gpu_count() if requested is None else 0)]
    if requested is None:
        return labels
    return labels[:requested] if len(labels) >= requested else [str(i) for i in range(requested)]


def nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver or no GPU: a CPU node
        return 0


def gather_cases(args: argparse.Namespace) -> list[Case]:
    if args.suite_json:
        cases = load_cases(args.suite_json)
    else:
        cases = collect_cases(args.tests, args.workdir)
    return select(cases, Selection(args.suite, args.tier, args.label, args.cases))


def plan_text(plan: Plan, labels: list[str]) -> str:
    lines = [f"{'start':>9} {'end':>9}  {'GPUs':<16} test"]
    for slot in sorted(plan.slots, key=lambda s: (s.start, s.name)):
        gpus = ",".join(labels[g] for g in slot.gpus) or "cpu"
        lines.append(f"{slot.start:9.0f} {slot.end:9.0f}  {gpus:<16} {slot.name}")
    for job in plan.unschedulable:
        lines.append(f"{'-':>9} {'-':>9}  {'-':<16} {job.name} (needs {job.gpus} GPUs, node has {len(labels)})")
    ratio = plan.makespan / plan.lower_bound if plan.lower_bound else 1.0
    lines.append(f"makespan {plan.makespan:.0f}s ({duration(plan.makespan)}), lower bound "
                 f"{plan.lower_bound:.0f}s ({duration(plan.lower_bound)}), ratio {ratio:.4f}")
    tighter = wide_job_bound(plan.order, len(labels))
    if tighter > plan.lower_bound * 1.0005:
        lines.append(f"no plan can beat {tighter:.0f}s here: tests wider than half the node "
                     f"never run together (makespan / that bound {plan.makespan / tighter:.4f})")
    return "\n".join(lines)


def plan_json(plan: Plan, labels: list[str]) -> list[dict]:
    def label(g: int):
        return int(labels[g]) if labels[g].isdigit() else labels[g]

    return [{**entry, "gpus": [label(g) for g in entry["gpus"]]} for entry in plan.as_json()]


def default_out(suite: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return REPO / "logs" / "ci" / f"{suite}-{stamp}"


def run(args: argparse.Namespace, cases: list[Case], plan: Plan, labels: list[str]) -> int:
    not_runnable = [c.name for c in cases if not c.nodeid]
    if not_runnable:
        print(f"cannot run cases without a nodeid (synthetic?): {', '.join(not_runnable)}",
              file=sys.stderr)
        return USAGE_ERROR
    suite = args.suite or (args.suite_json.stem if args.suite_json else "all")
    out = (args.out or default_out(suite)).resolve()
    history = History(args.history_db) if args.history_db else None
    settings = RunSettings(out, args.workdir, labels, history, load_thresholds(args.thresholds),
                           args.pytest_args, gpu_wait=args.gpu_wait)
    started = time.monotonic()
    # CI cancels with SIGTERM; turned into SystemExit it reaches the runner's clean-up
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        results = SuiteRunner(cases, plan, settings, on_finish=print_progress).run()
    finally:
        if history:
            history.close()
    wall = time.monotonic() - started
    write_junit(args.junit or out / "junit.xml", suite, results, wall)
    facts = RunFacts(suite, tuple(labels), plan.makespan, plan.lower_bound, wall,
                     str(args.history_db) if args.history_db else None)
    write_summary(args.summary or out / "summary.md", render(facts, results))
    failed = [r.name for r in results if r.failed]
    print(f"{len(results)} cases, {len(failed)} failed; JUnit and summary in {out}")
    return 1 if failed else 0


def print_progress(result) -> None:
    gate = f" [gate: {result.verdict.describe()}]" if result.verdict else ""
    print(f"{result.outcome:>8} {result.wall_time:7.1f}s  {result.name}{gate}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cases = gather_cases(args)
    except (CollectError, OSError, ValueError) as err:
        print(err, file=sys.stderr)
        return USAGE_ERROR
    if not cases:
        print("no case matches the selection", file=sys.stderr)
        return USAGE_ERROR
    labels = visible_gpu_labels(args.gpus)
    plan = make_plan([c.job for c in cases], range(len(labels)), max(args.cpu_jobs, 1),
                     iterations=args.search_iterations)
    if args.plan_json:
        entries = [json.dumps(e) for e in plan_json(plan, labels)]
        args.plan_json.write_text("[\n" + ",\n".join(entries) + "\n]\n")
    if args.plan:
        print(plan_text(plan, labels))
        return 0
    return run(args, cases, plan, labels)


if __name__ == "__main__":
    sys.exit(main())
