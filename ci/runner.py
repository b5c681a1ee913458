"""Runs planned cases as pytest subprocesses, each on the GPUs it was given.

Cases start in the plan's priority order whenever their GPUs (or a CPU slot) are free; a
completion is an event, so a case that ends early hands its GPUs on at once. Each case runs in
its own process group, so a timeout or an interrupted run can end everything it started.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ci.cases import PYTHON, Case
from ci.gpu_shares import devices_of
from ci.history import History, ThresholdRegistry, measurement_from_result
from ci.process_group import end_group
from ci.results import CaseResult, read_harness_result, settle_outcome, tail
from ci.scheduler import Dispatcher, Plan

# Beyond the case's own timeout, which the harness enforces inside (with its own slack for
# pytest-timeout); this only guards against a wedged pytest.
OUTER_TIMEOUT_GRACE = 300.0
# GPUs a finished case held can take a moment to show as free to the harness's lease
DEFAULT_GPU_WAIT = 120.0


@dataclass
class RunSettings:
    out_dir: Path
    workdir: Path
    gpu_labels: Sequence[str]  # CUDA_VISIBLE_DEVICES value of each pool index
    history: History | None = None
    thresholds: ThresholdRegistry | None = None
    pytest_args: Sequence[str] = ()
    timeout_grace: float = OUTER_TIMEOUT_GRACE
    gpu_wait: float = DEFAULT_GPU_WAIT
    # GPU cases run on shares of a device (--gpu-shares): their leases must not wait for it idle
    gpu_shared: bool = False
    # variables every case gets from the runner's environment (--case-env), also on Ray nodes
    case_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def results_dir(self) -> Path:
        return self.out_dir / "results"


def safe_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:180]


def case_argv(case: Case, settings: RunSettings) -> list[str]:
    """What runs for a case, less the JUnit flag: its own command, or pytest on its node id.
    "{python}" stands for the interpreter; whoever starts the command resolves it."""
    if case.command:
        return list(case.command)
    cmd = [PYTHON, "-m", "pytest", str(case.nodeid), "-q", "-p", "no:cacheprovider"]
    if case.gpus and settings.gpu_wait:
        cmd.append(f"--miles-gpu-wait={settings.gpu_wait:g}")
    if case.gpus and settings.gpu_shared:
        cmd.append("--miles-gpu-shared")
    return cmd + list(settings.pytest_args)


def resolve_python(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    return [python if word == PYTHON else word for word in argv]


def wants_junit(case: Case) -> bool:
    """pytest writes a JUnit file per case; a case's own command need not."""
    return not case.command


def local_command(case: Case, junit_path: Path, settings: RunSettings) -> list[str]:
    argv = resolve_python(case_argv(case, settings))
    return argv + [f"--junitxml={junit_path}"] if wants_junit(case) else argv


def case_deadline(case: Case, settings: RunSettings) -> float:
    wait = settings.gpu_wait if case.gpus else 0.0
    return case.timeout + wait + settings.timeout_grace


@dataclass(frozen=True)
class Ended:
    """How a case's process ended, wherever it ran."""

    exit_code: int
    timed_out: bool
    junit: Path


def conclude(result: CaseResult, ended: Ended, case: Case, settings: RunSettings) -> None:
    """The outcome of a finished case from the harness's result file (in results_dir), its
    JUnit file and its exit code; then its log tail if it failed, then the gate."""
    result.harness_result = read_harness_result(settings.results_dir, result.name)
    settle_outcome(result, ended.exit_code, ended.junit)
    if ended.timed_out:
        result.outcome = "timeout"
        result.message = f"ended after {result.wall_time:.0f}s (case timeout {case.timeout:.0f}s)"
    if result.failed and result.log_path:
        result.log_tail = tail(Path(result.log_path))
    gate(result, settings)


def gate(result: CaseResult, settings: RunSettings) -> None:
    if settings.history is None or result.harness_result is None:
        return
    measurement = measurement_from_result({**result.harness_result, "outcome": result.outcome,
                                           "name": result.name})
    limits = (settings.thresholds or ThresholdRegistry()).for_test(result.name)
    result.verdict = settings.history.gate(measurement, limits)


def unschedulable_result(case: Case, why: str) -> CaseResult:
    return CaseResult(case.name, case.nodeid, case.gpus, case.est_time, outcome="skipped",
                      message=why)


class _Launched:
    def __init__(self, case: Case, result: CaseResult, proc: subprocess.Popen, junit: Path):
        self.case, self.result, self.proc, self.junit = case, result, proc, junit
        self.started = time.monotonic()
        self.timed_out = False


class SuiteRunner:
    def __init__(self, cases: Sequence[Case], plan: Plan, settings: RunSettings,
                 on_finish: Callable[[CaseResult], None] | None = None):
        self.cases = {c.name: c for c in cases}
        self.plan = plan
        self.settings = settings
        self.on_finish = on_finish or (lambda result: None)
        self.done: "queue.Queue[_Launched]" = queue.Queue()
        self.running: dict[str, _Launched] = {}
        self.results: dict[str, CaseResult] = {}

    def run(self) -> list[CaseResult]:
        for directory in ("logs", "junit", "results"):
            (self.settings.out_dir / directory).mkdir(parents=True, exist_ok=True)
        self._skip_unschedulable()
        dispatcher = Dispatcher(self.plan.order, self.plan.pool, self.plan.cpu_slots)
        try:
            self._dispatch(dispatcher, time.monotonic())
        except (KeyboardInterrupt, SystemExit):
            # a cancelled CI job still gets its reports, naming what never finished
            self._abandon(dispatcher)
        finally:
            for launched in list(self.running.values()):
                end_group(launched.proc)
        return [self.results[name] for name in self.cases if name in self.results]

    def _dispatch(self, dispatcher: Dispatcher, t0: float) -> None:
        while True:
            for job, gpus in dispatcher.start_ready():
                self._launch(self.cases[job.name], gpus, time.monotonic() - t0)
            if not self.running:
                return
            try:
                finished = self.done.get(timeout=1.0)
            except queue.Empty:
                continue
            del self.running[finished.case.name]
            dispatcher.release(finished.case.name)
            self._finish(finished)

    def _abandon(self, dispatcher: Dispatcher) -> None:
        for launched in list(self.running.values()):
            end_group(launched.proc)
            result = launched.result
            result.wall_time = time.monotonic() - launched.started
            result.outcome, result.message = "error", "interrupted: the suite run was cancelled"
            result.log_tail = tail(Path(result.log_path))
            self.results[result.name] = result
        for job in dispatcher.waiting:
            case = self.cases[job.name]
            self.results[case.name] = CaseResult(
                case.name, case.nodeid, case.gpus, case.est_time, outcome="skipped",
                message="not started: the suite run was cancelled")

    def _skip_unschedulable(self) -> None:
        for job in self.plan.unschedulable:
            case = self.cases[job.name]
            self.results[case.name] = unschedulable_result(
                case, f"needs {case.gpus} GPUs, the node has {len(self.plan.pool)}")

    def _launch(self, case: Case, gpus: tuple[int, ...], offset: float) -> None:
        stem = safe_filename(case.name)
        log_path = self.settings.out_dir / "logs" / f"{stem}.log"
        junit = self.settings.out_dir / "junit" / f"{stem}.xml"
        env = {**os.environ, **self.settings.case_env}
        labels = [self.settings.gpu_labels[g] for g in gpus]
        env["CUDA_VISIBLE_DEVICES"] = devices_of(labels)  # shares of one GPU name it once
        env["MILES_RESULTS_DIR"] = str(self.settings.results_dir)
        result = CaseResult(case.name, case.nodeid, case.gpus, case.est_time,
                            gpus=tuple(dict.fromkeys(labels)),
                            start=offset, log_path=str(log_path))
        command = local_command(case, junit, self.settings)
        with open(log_path, "w") as log:
            log.write(f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(command,
                                    cwd=self.settings.workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        launched = _Launched(case, result, proc, junit)
        self.running[case.name] = launched
        threading.Thread(target=self._wait, args=(launched,), daemon=True).start()

    def _wait(self, launched: _Launched) -> None:
        try:
            launched.proc.wait(timeout=case_deadline(launched.case, self.settings))
        except subprocess.TimeoutExpired:
            launched.timed_out = True
            end_group(launched.proc)
        self.done.put(launched)

    def _finish(self, launched: _Launched) -> None:
        result = launched.result
        result.wall_time = time.monotonic() - launched.started
        ended = Ended(launched.proc.returncode, launched.timed_out, launched.junit)
        conclude(result, ended, launched.case, self.settings)
        self.results[result.name] = result
        self.on_finish(result)
