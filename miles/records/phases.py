"""Where a run's wall time goes: named marks, appended as JSON lines to the file that
`MILES_PHASES_FILE` names (nothing is written when it is unset).

The harness sets the variable for every real run it starts; the launcher forwards it into the
job, so the recipe process, the launcher, the trainer's driver and every actor mark the same
file. `benchmarks/bench_test_suite.py` and the CI summary turn the marks into a breakdown
(Ray head start, job submission, each actor's start-up and imports, the training loop, teardown).
One short line per `write` on a file opened for appending, so processes never interleave a line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

PHASES_ENV = "MILES_PHASES_FILE"


def mark(phase: str, **fields: object) -> None:
    """Append `{"phase", "t", "pid", **fields}`; `t=` overrides the time (e.g. a process start)."""
    path = os.environ.get(PHASES_ENV)
    if not path:
        return
    record = {"phase": phase, "t": time.time(), "pid": os.getpid(), **fields}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    except OSError:
        pass  # timing is a diagnostic: never the reason a run fails


def process_started_at() -> float:
    """When this process was started (the actor's worker process, before its imports)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()


def seconds_since_process_start() -> float:
    return time.time() - process_started_at()


def read_marks(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    marks = []
    for line in path.read_text().splitlines():
        try:
            marks.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(marks, key=lambda m: m["t"])


# Each phase of the breakdown: (label, start mark, end mark). A missing mark drops the row.
BREAKDOWN = (
    ("recipe process start-up (python, imports)", "recipe_process_start", "recipe_start"),
    ("preparation (checkpoint, prompt files)", "recipe_start", "launch_start"),
    ("launch planning, argv validation", "launch_start", "launch_planned"),
    ("Ray head start", "ray_head_start", "ray_head_ready"),
    ("job submission until the driver runs", "job_submit", "driver_process_start"),
    ("driver imports (torch, Ray, trainer)", "driver_process_start", "driver_imports_done"),
    ("actors start-up (placement to all ready)", "driver_imports_done", "actors_ready"),
    ("training loop", "loop_start", "loop_end"),
    ("driver shutdown until the job ends", "loop_end", "job_end"),
    ("  curves and sample grid written", "loop_end", "driver_outputs_written"),
    ("  actors and placement group released", "driver_outputs_written", "driver_end"),
    ("  driver exit until the launcher sees the job end", "driver_end", "job_end"),
    ("teardown (cluster ended)", "job_end", "teardown_end"),
)


def _first(marks: Iterable[Mapping], phase: str) -> float | None:
    for m in marks:
        if m.get("phase") == phase:
            return float(m["t"])
    return None


def actor_init(role: str) -> None:
    """At the top of an actor's constructor: its worker process start is recorded with it."""
    mark("actor_init", role=role, process_started=process_started_at())


def actor_ready(role: str) -> None:
    """When the actor can work (model loaded, process group up)."""
    mark("actor_ready", role=role)


def _actor_rows(marks: list[Mapping]) -> list[tuple[str, float]]:
    rows = []
    inits = {(m.get("pid"), m.get("role")): m for m in marks if m.get("phase") == "actor_init"}
    for m in marks:
        init = inits.get((m.get("pid"), m.get("role")))
        if m.get("phase") != "actor_ready" or init is None:
            continue
        rows.append((f"  {m['role']}: worker process start and module imports",
                     float(init["t"]) - float(init["process_started"])))
        rows.append((f"  {m['role']}: model load and set-up", float(m["t"]) - float(init["t"])))
    return rows


def breakdown(marks: list[Mapping]) -> list[tuple[str, float]]:
    """(label, seconds) per phase present, in order, then two rows per actor's start-up."""
    rows = []
    for label, start, end in BREAKDOWN:
        t0, t1 = _first(marks, start), _first(marks, end)
        if t0 is not None and t1 is not None:
            rows.append((label, t1 - t0))
    rows += _actor_rows(marks)
    if marks:
        rows.append(("total (first mark to last)", float(marks[-1]["t"]) - float(marks[0]["t"])))
    return rows
