"""Real runs: a recipe in its own process group, marked with a token, under a timeout.

Every process a run starts — the recipe, the launcher's `ray start` daemons, Ray workers, the
trainer — inherits `MILES_TEST_TOKEN=<token>` from the recipe's environment. Ray daemons leave
the recipe's process group (they call setsid), so ending a run means: every process whose
`/proc/<pid>/environ` carries the token at the moment it is signalled, escalating from SIGTERM to
SIGKILL. No process group is signalled and nothing is ever matched by name. After every run the harness asserts that no process carrying
the token is alive.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from miles.testing.cases import RecipeCase
from miles.testing.invariants import PARITY_KEYS
from miles.records.phases import PHASES_ENV, breakdown, read_marks
from miles.launcher import processes as _processes
from miles.testing.dry import scrubbed_env, tail

TOKEN_ENV = "MILES_TEST_TOKEN"
LOG_TAIL_LINES = 200
HARNESS_QUIET_S = 1.0  # see end_processes
PHASES_FILE = "phases.jsonl"


def new_token() -> str:
    return f"miles-test-{uuid.uuid4().hex}"


# -- finding and ending processes ---------------------------------------------------------
# One implementation for launcher and harness: miles.launcher.processes. Every signal
# goes to a pid that carries the token at that moment; a process group id is never signalled
# (once the recipe has exited its group id may belong to an unrelated process).

def token_pids(token: str, env_name: str = TOKEN_ENV) -> list[int]:
    """Live processes whose environment holds `<env_name>=<token>`."""
    return _processes.pids_with_token(token, env_name)


describe = _processes.describe


# Ray's job supervisor watches its job with `while kill -s 0 <pid>; do sleep 1; done` in the job's
# environment, so a `sleep 1` of it can outlive a finished job by up to a second (seen once: 0.8 s
# old, on an external cluster the launcher does not tear down). Such a process is not one the
# launcher left behind: give it this long to go by itself before the harness counts what it ends.
WATCHDOG_SETTLE_S = 1.5


def _let_watchdogs_finish(token: str, poll: Callable[[], None]) -> None:
    deadline = time.monotonic() + WATCHDOG_SETTLE_S
    while time.monotonic() < deadline:
        poll()
        if not _processes.pids_with_token(token, TOKEN_ENV):
            return
        time.sleep(0.1)


def end_processes(
    token: str | None,
    pgid: int | None = None,
    *,
    grace: float = 10.0,
    reap: Sequence[subprocess.Popen] = (),
    sessions: Sequence[int] = (),
) -> tuple[list[str], list[str]]:
    """End every process carrying `token`: SIGTERM, then SIGKILL after `grace` seconds.

    `pgid` is accepted for callers that still pass the recipe's group and is never signalled:
    everything a run starts inherits the token, which is verified before each signal. `sessions`:
    those `ray start` ran in, whose members are ended too (a raylet starts its dashboard agent
    without the token; miles.launcher.processes). Returns (ended, survivors) as
    "pid cmdline" strings.
    """
    del pgid
    if not token:
        for p in reap:
            p.poll()
        return [], []

    def poll_children() -> None:
        for p in reap:
            p.poll()

    _let_watchdogs_finish(token, poll_children)
    found: dict[int, str] = {}
    # the launcher waits out a raylet's respawns (processes.QUIET_S) before it exits; behind it this
    # backstop needs a shorter quiet window (it is the first cleanup only when the launcher was killed)
    ended, survivors = _processes.end_marked_processes(token, TOKEN_ENV, grace_s=grace, on_poll=poll_children,
                                                       descriptions=found, quiet_s=HARNESS_QUIET_S,
                                                       sessions=sessions)
    return [found.get(p) or describe(p) for p in ended], [describe(p) for p in survivors]


# -- a run and its record -------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


@dataclass
class RecipeRun:
    case: RecipeCase
    command: list[str]
    cwd: Path
    out_dir: Path
    log_path: Path
    token: str
    env_overrides: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    wall_time: float = 0.0
    ended: list[str] = field(default_factory=list)  # processes the harness had to end
    survivors: list[str] = field(default_factory=list)  # processes alive after ending them

    # -- what the run left ---------------------------------------------------------------
    @property
    def run_dir(self) -> Path | None:
        for name in ("plan.json", "run.json", "metrics.jsonl"):
            found = sorted(self.out_dir.glob(f"*/{name}"))
            if found:
                return found[0].parent
        return None

    def _json(self, name: str) -> dict | None:
        rd = self.run_dir
        if rd is None or not (rd / name).is_file():
            return None
        try:
            return json.loads((rd / name).read_text())
        except json.JSONDecodeError:
            return None

    @property
    def plan(self) -> dict | None:
        return self._json("plan.json")

    @property
    def run_json(self) -> dict | None:
        return self._json("run.json")

    @property
    def metrics(self) -> list[dict]:
        rd = self.run_dir
        return _read_jsonl(rd / "metrics.jsonl") if rd is not None else []

    @property
    def perf(self) -> list[dict]:
        """perf/* rows: perf.jsonl (the trainer keeps them out of metrics.jsonl under
        --deterministic-mode so that file is reproducible), else metrics.jsonl's perf keys."""
        rd = self.run_dir
        rows = _read_jsonl(rd / "perf.jsonl") if rd is not None else []
        return rows or [{k: v for k, v in r.items() if k == "rollout_id" or k.startswith("perf/")}
                        for r in self.metrics]

    @property
    def argv(self) -> list[str]:
        for source in (self.plan, self.run_json):
            if source and source.get("argv"):
                return [str(a) for a in source["argv"]]
        return []

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.survivors

    def phases(self) -> list[tuple[str, float]]:
        """(label, seconds) per phase of the run: Ray start, submission, actors, loop, teardown."""
        return breakdown(read_marks(self.out_dir / PHASES_FILE))

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            return tail(self.log_path.read_text(errors="replace"), n)
        except OSError:
            return "(no log)"

    def series(self, key: str) -> list[float]:
        rows = self.perf if key.startswith("perf/") else self.metrics
        return [row[key] for row in rows if key in row]

    def training_time(self) -> float:
        """Seconds inside the training loop: the sum of perf/step_time (or rollout + train time)."""
        total = 0.0
        for row in self.perf:
            if _finite(row.get("perf/step_time")):
                total += row["perf/step_time"]
            else:
                total += sum(row[k] for k in ("perf/rollout_time", "perf/train_time") if _finite(row.get(k)))
        return total

    # -- reports -------------------------------------------------------------------------
    def status(self) -> str:
        if self.timed_out:
            return f"timed out after {self.case.timeout:.0f}s and was ended"
        if self.returncode is None:
            return "did not finish"
        return f"exited with code {self.returncode}"

    def report(self, headline: str | None = None, tail_lines: int = LOG_TAIL_LINES) -> str:
        from miles.testing.snapshot import group_flags

        lines = [headline or f"recipe {self.case.script} {self.status()}"]
        lines.append(f"case: {self.case.name} (tier {self.case.tier}); wall time {self.wall_time:.1f}s; "
                     f"{self.status()}")
        lines.append(f"command: {' '.join(self.command)}")
        if self.env_overrides:
            lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(self.env_overrides.items())))
        lines.append(f"output dir: {self.out_dir}")
        if self.ended:
            lines.append(f"processes ended by the harness ({len(self.ended)}):")
            lines += [f"    {p}" for p in self.ended[:40]]
        if self.survivors:
            lines.append(f"processes STILL ALIVE after SIGKILL ({len(self.survivors)}):")
            lines += [f"    {p}" for p in self.survivors]
        argv = self.argv
        if argv:
            lines.append("train argv:")
            lines += ["    " + " ".join(g) for g in group_flags(argv)]
        run_json = self.run_json
        if run_json:
            prov = {k: v for k, v in run_json.items() if k != "argv"}
            lines.append("provenance (run.json):")
            lines += ["    " + l for l in json.dumps(prov, indent=2, sort_keys=True, default=str).splitlines()]
        else:
            lines.append("provenance: no run.json was written")
        lines.append(f"--- last {tail_lines} lines of {self.log_path} ---")
        lines.append(self.log_tail(tail_lines))
        return "\n".join(lines)

    def result_record(self, outcome: str, nodeid: str = "", extra: Mapping[str, Any] | None = None) -> dict:
        """The per-run record written under MILES_RESULTS_DIR (docs/testing.md)."""
        thr = [v for v in self.series("perf/train_pairs_per_sec") if _finite(v)]
        mem = [v for v in self.series("perf/peak_memory_bytes") if _finite(v)]
        parity = [abs(v) for key in PARITY_KEYS for v in self.series(key) if _finite(v)]
        record = {
            "nodeid": nodeid,
            "name": self.case.name,
            "outcome": outcome,
            "wall_time": round(self.wall_time, 3),
            "run_json": self.run_json,
            "throughput": {"last": thr[-1], "mean": sum(thr) / len(thr)} if thr else None,
            "peak_memory": max(mem) if mem else None,
            # the largest train/rollout parity difference of any rollout (None: not probed)
            "parity_max_diff": max(parity) if parity else None,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "phases": [[label, round(seconds, 3)] for label, seconds in self.phases()],
        }
        record.update(extra or {})
        return record


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def write_result_record(results_dir: str | Path, record: Mapping[str, Any]) -> Path:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{record['name']}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def run_recipe(
    case: RecipeCase,
    out_dir: str | Path,
    *,
    rootdir: Path | None = None,
    token: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    grace: float = 10.0,
) -> RecipeRun:
    """Run the recipe for real and end everything it started. Never raises on recipe failure:
    inspect `run.ok` / `run.report()`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    token = token or new_token()
    script = case.script_path(rootdir)
    cwd = case.repo_root(rootdir)
    command = [sys.executable, str(script), *case.args, *extra_args, "--output-dir", str(out_dir)]
    overrides = {
        "MILES_SCRIPT_DATA_DIR": str(out_dir / "data"),
        "PYTHONUNBUFFERED": "1",
        "NO_COLOR": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # NVML's order, so leased indices mean the same GPUs
        PHASES_ENV: str(out_dir / PHASES_FILE),  # where the run's time goes (miles.records.phases)
    }
    overrides.update(case.env)
    overrides.update(env or {})
    full_env = scrubbed_env()
    full_env.update(overrides)
    full_env[TOKEN_ENV] = token
    log_path = out_dir / "recipe.log"
    run = RecipeRun(case, command, cwd, out_dir, log_path, token, overrides)
    limit = timeout if timeout is not None else case.timeout
    start = time.monotonic()
    proc: subprocess.Popen | None = None
    try:
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            try:
                run.returncode = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                run.timed_out = True
    finally:
        # Also on KeyboardInterrupt or pytest-timeout: the run must not outlive the test.
        run.wall_time = time.monotonic() - start
        pgid = proc.pid if proc is not None else None
        run.ended, run.survivors = end_processes(token, pgid, grace=grace, reap=[proc] if proc else [])
        if proc is not None and run.returncode is None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if not run.timed_out:
                run.returncode = proc.returncode
        if run.timed_out:
            with open(log_path, "ab") as log:
                log.write(f"\n[miles.testing] ended after {limit:.0f}s timeout; "
                          f"{len(run.ended)} processes signalled\n".encode())
    return run
