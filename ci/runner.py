"""Runs planned cases as pytest subprocesses, each on the GPUs it was given.

Cases start in the plan's priority order whenever their GPUs (or a CPU slot) are free; a
completion is an event, so a case that ends early hands its GPUs on at once. Each case runs in
its own process group, so a timeout or an interrupted run can end everything it started.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ci.cases import Case
from ci.history import History, ThresholdRegistry, measurement_from_result
from ci.results import CaseResult, read_harness_result, settle_outcome, tail
from ci.scheduler import Dispatcher, Plan

# Beyond the case's own timeout, which the harness enforces inside (with its own slack for
# pytest-timeout); this only guards against a wedged pytest.
OUTER_TIMEOUT_GRACE = 300.0
# GPUs a finished case held can take a moment to show as free to the harness's lease
DEFAULT_GPU_WAIT = 120.0
KILL_GRACE = 15.0


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

    @property
    def results_dir(self) -> Path:
        return self.out_dir / "results"


def safe_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:180]


def pytest_command(case: Case, junit_path: Path, settings: RunSettings) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", case.nodeid, "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit_path}"]
    if case.gpus and settings.gpu_wait:
        cmd.append(f"--miles-gpu-wait={settings.gpu_wait:g}")
    return cmd + list(settings.pytest_args)


class _Launched:
    def __init__(self, case: Case, result: CaseResult, proc: subprocess.Popen, junit: Path):
        self.case, self.result, self.proc, self.junit = case, result, proc, junit
        self.started = time.monotonic()
        self.timed_out = False


def end_group(proc: subprocess.Popen) -> None:
    """Ends the case's whole process group: the harness may have started Ray and more."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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
            self.results[case.name] = CaseResult(
                case.name, case.nodeid, case.gpus, case.est_time, outcome="skipped",
                message=f"needs {case.gpus} GPUs, the node has {len(self.plan.pool)}")

    def _launch(self, case: Case, gpus: tuple[int, ...], offset: float) -> None:
        stem = safe_filename(case.name)
        log_path = self.settings.out_dir / "logs" / f"{stem}.log"
        junit = self.settings.out_dir / "junit" / f"{stem}.xml"
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.settings.gpu_labels[g] for g in gpus)
        env["MILES_RESULTS_DIR"] = str(self.settings.results_dir)
        result = CaseResult(case.name, case.nodeid, case.gpus, case.est_time,
                            gpus=tuple(self.settings.gpu_labels[g] for g in gpus),
                            start=offset, log_path=str(log_path))
        with open(log_path, "w") as log:
            log.write(f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                      f"{' '.join(pytest_command(case, junit, self.settings))}\n")
            log.flush()
            proc = subprocess.Popen(pytest_command(case, junit, self.settings),
                                    cwd=self.settings.workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        launched = _Launched(case, result, proc, junit)
        self.running[case.name] = launched
        threading.Thread(target=self._wait, args=(launched,), daemon=True).start()

    def _wait(self, launched: _Launched) -> None:
        try:
            launched.proc.wait(timeout=self._deadline(launched.case))
        except subprocess.TimeoutExpired:
            launched.timed_out = True
            end_group(launched.proc)
        self.done.put(launched)

    def _deadline(self, case: Case) -> float:
        wait = self.settings.gpu_wait if case.gpus else 0.0
        return case.timeout + wait + self.settings.timeout_grace

    def _finish(self, launched: _Launched) -> None:
        result = launched.result
        result.wall_time = time.monotonic() - launched.started
        result.harness_result = read_harness_result(self.settings.results_dir, result.name)
        settle_outcome(result, launched.proc.returncode, launched.junit)
        if launched.timed_out:
            result.outcome = "timeout"
            result.message = f"ended after {result.wall_time:.0f}s (case timeout {launched.case.timeout:.0f}s)"
        if result.failed:
            result.log_tail = tail(Path(result.log_path))
        self._gate(result)
        self.results[result.name] = result
        self.on_finish(result)

    def _gate(self, result: CaseResult) -> None:
        if self.settings.history is None or result.harness_result is None:
            return
        measurement = measurement_from_result({**result.harness_result, "outcome": result.outcome,
                                               "name": result.name})
        limits = (self.settings.thresholds or ThresholdRegistry()).for_test(result.name)
        result.verdict = self.settings.history.gate(measurement, limits)
