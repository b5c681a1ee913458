#!/usr/bin/env python3
"""Runs a suite of recipe test cases on one node, packing them onto its GPUs, or on a Ray
cluster of GPU nodes (--ray-address, or MILES_CI_RAY_ADDRESS), which places them.

    python3 ci/run_suite.py --suite nightly-gpu --tier gpu --history-db ~/.cache/miles-ci/history.sqlite
    python3 ci/run_suite.py --suite-json suite.json --gpus 8 --plan
    python3 ci/run_suite.py --suite nightly-gpu --ray-address HEAD:6379 --retry-lost 1

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
from ci.gpu_shares import ShareSpec, devices_of, on_shares, share_labels  # noqa: E402
from ci.history import History, load_thresholds  # noqa: E402
from ci.junit import write_junit  # noqa: E402
from ci.results import CaseResult  # noqa: E402
from ci.runner import DEFAULT_GPU_WAIT, RunSettings, SuiteRunner  # noqa: E402
from ci.scheduler import Plan, make_plan, wide_job_bound  # noqa: E402
from ci.summary import RunFacts, duration, render, write_summary  # noqa: E402
from miles.utils.cli_types import at_least  # noqa: E402

DEFAULT_THRESHOLDS = REPO / "ci" / "thresholds.yaml"
USAGE_ERROR = 2
NODE_LOST_EXIT = 3  # nothing failed but cases whose node died (and were not rerun)
RAY_ADDRESS_ENV = "MILES_CI_RAY_ADDRESS"


class OneLineErrorParser(argparse.ArgumentParser):
    """A bad flag or value: one `error:` line with its fix on stderr, exit 2 (no usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(USAGE_ERROR, f"error: {message}; fix: give that flag a value it takes, or drop it "
                               f"(python3 ci/run_suite.py --help lists the flags and their values)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--gpus", type=at_least(1), help="node size (default: CUDA_VISIBLE_DEVICES, else NVML)")
    p.add_argument("--cpu-jobs", type=at_least(1), default=2, help="CPU-only cases run at once")
    p.add_argument("--plan", action="store_true",
                   help="print the schedule, run nothing; contacts no cluster (with --ray-address: plans "
                        "on --gpus N)")
    p.add_argument("--plan-json", type=Path, help="write the schedule as JSON")
    p.add_argument("--out", type=Path, help="logs, results, JUnit and summary (default logs/ci/...)")
    p.add_argument("--junit", type=Path, help="JUnit XML path (default OUT/junit.xml)")
    p.add_argument("--summary", type=Path, help="Markdown summary path (default OUT/summary.md)")
    p.add_argument("--history-db", type=Path, help="SQLite history for the speed and memory gate")
    p.add_argument("--thresholds", type=Path, default=DEFAULT_THRESHOLDS,
                   help="gate thresholds, defaults and per test (YAML)")
    p.add_argument("--search-iterations", type=at_least(0), default=1500,
                   help="local-search steps spent improving the packing")
    p.add_argument("--gpu-wait", type=float, default=DEFAULT_GPU_WAIT,
                   help="seconds a GPU case's lease may wait for its GPUs to show free (0: off)")
    p.add_argument("--workdir", type=Path, default=REPO,
                   help="where pytest runs (in Ray mode: the same path on every node)")
    p.add_argument("--ray-address", default=os.environ.get(RAY_ADDRESS_ENV) or None,
                   help=f"run the cases on this Ray cluster (host:port of its GCS, or 'auto'; "
                        f"default ${RAY_ADDRESS_ENV})")
    p.add_argument("--ray-working-dir", type=Path,
                   help="upload this directory to the nodes as the cases' working dir, "
                        "instead of finding the repository at --workdir on each node")
    p.add_argument("--retry-lost", type=at_least(0), default=0,
                   help="Ray mode: rerun a case this many times when its node dies under it")
    p.add_argument("--gpu-shares", type=at_least(1), default=1,
                   help="split each GPU into this many shares and pack one-GPU cases that state "
                        "their gpu_memory_gib onto them by memory (several cases on one device; "
                        "one GPU on a single node)")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="memory of one GPU for --gpu-shares (default: NVML's figure for GPU 0)")
    p.add_argument("--case-env", action="append", default=[], metavar="NAME",
                   help="give every case this variable's value from the runner's environment "
                        "(repeatable; on a Ray cluster the cases otherwise see their node's)")
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


def nvml_gpu_memory_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / 2**30
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no GPU
        return None


def share_spec(args: argparse.Namespace) -> ShareSpec | None:
    """None without --gpu-shares; raises ValueError naming the flag when it cannot be used."""
    if args.gpu_shares == 1:
        if args.gpu_memory_gib is not None:
            raise ValueError("--gpu-memory-gib sizes the shares of --gpu-shares; fix: give --gpu-shares K too, "
                             "or drop --gpu-memory-gib")
        return None
    device_gib = args.gpu_memory_gib or nvml_gpu_memory_gib()
    if device_gib is None:
        raise ValueError("--gpu-shares needs the GPU's memory and NVML has none here; fix: give "
                         "--gpu-memory-gib G (one GPU's memory in GiB)")
    return ShareSpec(args.gpu_shares, device_gib)


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
        gpus = devices_of(labels[g] for g in slot.gpus) or "cpu"
        if len(slot.gpus) > len(gpus.split(",")):  # shares of a device (--gpu-shares)
            gpus += f" ({len(slot.gpus)} shares)"
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

    def placed(entry: dict) -> dict:
        labels_used = [label(g) for g in entry["gpus"]]
        devices = list(dict.fromkeys(labels_used))
        if len(devices) == len(labels_used):
            return {**entry, "gpus": devices}
        return {**entry, "gpus": devices, "shares": len(labels_used)}  # --gpu-shares

    return [placed(entry) for entry in plan.as_json()]


def default_out(suite: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return REPO / "logs" / "ci" / f"{suite}-{stamp}"


def run(args: argparse.Namespace, cases: list[Case], plan: Plan, labels: list[str],
        backend=None, cluster: str | None = None) -> int:
    """Runs the cases (on this node, or through `backend(settings)` on a cluster) and writes
    the JUnit file, the summary and the gate's history: the same for both."""
    not_runnable = [c.name for c in cases if not c.runnable]
    if not_runnable:
        print(f"error: cases without a nodeid or command cannot run (synthetic?): {', '.join(not_runnable)}; fix: "
              f"give each a \"nodeid\" or a \"command\" in --suite-json, or only plan them (--plan)", file=sys.stderr)
        return USAGE_ERROR
    suite = args.suite or (args.suite_json.stem if args.suite_json else "all")
    out = (args.out or default_out(suite)).resolve()
    history = History(args.history_db) if args.history_db else None
    settings = RunSettings(out, args.workdir, labels, history, load_thresholds(args.thresholds),
                           args.pytest_args, gpu_wait=args.gpu_wait, gpu_shared=args.gpu_shares > 1,
                           case_env={name: os.environ[name] for name in args.case_env})
    started = time.monotonic()
    # CI cancels with SIGTERM; turned into SystemExit it reaches the runner's clean-up
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        runner = backend(settings) if backend else SuiteRunner(cases, plan, settings,
                                                               on_finish=print_progress)
        results = in_case_order(runner.run(), cases)
    finally:
        if history:
            history.close()
    wall = time.monotonic() - started
    write_junit(args.junit or out / "junit.xml", suite, results, wall)
    facts = RunFacts(suite, tuple(labels), plan.makespan, plan.lower_bound, wall,
                     str(args.history_db) if args.history_db else None,
                     achieved_makespan(results), cluster)
    write_summary(args.summary or out / "summary.md", render(facts, results))
    failed = [r.name for r in results if r.failed]
    ratio = f"{facts.achieved_makespan / plan.lower_bound:.3f}" if plan.lower_bound else "-"
    print(f"{len(results)} cases, {len(failed)} failed; achieved makespan "
          f"{facts.achieved_makespan:.1f}s, lower bound {plan.lower_bound:.1f}s (ratio {ratio}); "
          f"JUnit and summary in {out}")
    return exit_code(results)


def in_case_order(results: list[CaseResult], cases: list[Case]) -> list[CaseResult]:
    by_name = {r.name: r for r in results}
    return [by_name[c.name] for c in cases if c.name in by_name]


def achieved_makespan(results: list[CaseResult]) -> float:
    """The schedule's makespan: from the first case's start to the last case's end (what the
    plan's makespan predicts; the wall time beside it also counts connecting and reporting)."""
    ran = [r for r in results if r.wall_time]
    if not ran:
        return 0.0
    return max(r.start + r.wall_time for r in ran) - min(r.start for r in ran)


def exit_code(results: list[CaseResult]) -> int:
    failed = [r for r in results if r.failed]
    if not failed:
        return 0
    return NODE_LOST_EXIT if all(r.node_lost for r in failed) else 1


def run_on_ray(args: argparse.Namespace, cases: list[Case]) -> int:
    """The cluster's GPUs are the pool: plan on their total, submit in the plan's order."""
    from ci import ray_backend

    shares = args.gpu_shares
    options = ray_backend.RayOptions(args.ray_address, max(args.retry_lost, 0), args.ray_working_dir,
                                     gpu_shares=shares)
    ray_backend.connect(options, REPO)
    try:
        nodes = [n for n in ray_backend.gpu_nodes(shares) if n.gpus] or ray_backend.gpu_nodes(shares)
        # a pool entry per share; the label names the device
        labels = [f"{n.node_id[:6]}:{i // shares}" for n in nodes for i in range(n.gpus)]
        in_shares = f" in shares of {shares} per GPU" if shares > 1 else ""
        cluster = (f"at {args.ray_address}: {len(nodes)} nodes, {len(labels) // shares} GPUs "
                   f"({' + '.join(str(n.gpus // shares) for n in nodes)}){in_shares}")
        # the GPUs of all nodes together are the plan's pool; cases that need more than half a
        # node (or several nodes) lead the order: planned late, they would wait for a drain
        wide = ray_backend.lead_cases(cases, nodes)
        plan = plan_and_show(args, cases, labels, first=tuple(c.name for c in wide))
        if args.plan:
            return 0

        def backend(settings: RunSettings):
            return ray_backend.RaySuiteRunner(cases, plan, settings, options, nodes,
                                              lead=len(wide), on_finish=print_progress)

        return run(args, cases, plan, labels, backend, cluster)
    finally:
        import ray

        ray.shutdown()


def plan_and_show(args: argparse.Namespace, cases: list[Case], labels: list[str],
                  first: tuple[str, ...] = ()) -> Plan:
    plan = make_plan([c.job for c in cases], range(len(labels)), max(args.cpu_jobs, 1),
                     iterations=args.search_iterations, first=first)
    if args.plan_json:
        entries = [json.dumps(e) for e in plan_json(plan, labels)]
        args.plan_json.write_text("[\n" + ",\n".join(entries) + "\n]\n")
    if args.plan:
        print(plan_text(plan, labels))
    return plan


def print_progress(result) -> None:
    gate = f" [gate: {result.verdict.describe()}]" if result.verdict else ""
    print(f"{result.outcome:>8} {result.wall_time:7.1f}s  {result.name}{gate}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cases = gather_cases(args)
    except CollectError as err:  # its message carries its fix
        where = f"--suite-json {args.suite_json}: " if args.suite_json else ""
        print(f"error: {where}{err}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as err:  # pytest could not be started where --workdir says
        print(f"error: collecting the cases under --workdir {args.workdir}: {err.strerror or err}; fix: give "
              f"--workdir the repository's path", file=sys.stderr)
        return USAGE_ERROR
    if not cases:
        chosen = " ".join([f"--suite {args.suite}"] * bool(args.suite) + [f"--case {c}" for c in args.cases]
                          + [f"--tier {t}" for t in args.tier] + [f"--label {x}" for x in args.label])
        print(f"error: no case matches {chosen or 'the selection'}; fix: pick a suite and cases the harness has "
              f"(python3 -m pytest {args.tests} --collect-only -q lists them)", file=sys.stderr)
        return USAGE_ERROR
    unset = [name for name in args.case_env if name not in os.environ]
    if unset:
        print(f"error: --case-env {unset[0]}: {unset[0]} is not set here; fix: export {unset[0]} first, or drop "
              f"--case-env {unset[0]}", file=sys.stderr)
        return USAGE_ERROR
    try:
        spec = share_spec(args)
        cases = on_shares(cases, spec) if spec else cases
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_ERROR
    if args.ray_address and args.plan:
        if args.gpus is None:
            print(f"error: --plan with --ray-address {args.ray_address} plans without contacting the cluster; "
                  f"fix: give its GPU count as --gpus N", file=sys.stderr)
            return USAGE_ERROR
        print(f"planning for --gpus {args.gpus}; the cluster at {args.ray_address} is not contacted by --plan")
    elif args.ray_address:
        from ci.ray_reach import RayAddressError, check_reachable

        try:
            check_reachable(args.ray_address)
        except RayAddressError as err:
            print(f"error: {err}", file=sys.stderr)
            return USAGE_ERROR
        return run_on_ray(args, cases)
    labels = visible_gpu_labels(args.gpus)
    if spec:
        if len(labels) != 1:
            print(f"error: --gpu-shares splits one GPU and this node's pool has {len(labels)}; fix: give --gpus 1 "
                  f"or set CUDA_VISIBLE_DEVICES to one GPU", file=sys.stderr)
            return USAGE_ERROR
        labels = share_labels(labels, spec.shares)
    plan = plan_and_show(args, cases, labels)
    if args.plan:
        return 0
    return run(args, cases, plan, labels)


if __name__ == "__main__":
    sys.exit(main())
