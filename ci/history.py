"""The speed and memory gate: each test against its own recent passing runs.

Every run of a test is stored in a local SQLite file with its throughput, peak memory, wall
time and the environment it ran in (torch, CUDA and driver versions, GPU model, from the run's
run.json). A new run is compared with the median of the recent passing runs of the same test on
the same GPU model; a throughput drop or a peak-memory rise beyond the test's thresholds fails
it. When the software environment differs from the baseline's, the verdict says what changed:
an upgrade is the usual cause of a regression and must be named, not averaged away.
"""

from __future__ import annotations

import sqlite3
import statistics
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

import yaml

BASELINE_RUNS = 5
ENV_KEYS = ("torch", "cuda", "driver", "python")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    test TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    outcome TEXT NOT NULL,
    gate_ok INTEGER NOT NULL,
    throughput REAL,
    peak_memory REAL,
    wall_time REAL,
    gpu_model TEXT NOT NULL,
    torch TEXT,
    cuda TEXT,
    driver TEXT,
    python TEXT,
    git_commit TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_test ON runs (test, gpu_model, id);
"""


@dataclass(frozen=True)
class Fingerprint:
    gpu_model: str = "cpu"
    torch: str | None = None
    cuda: str | None = None
    driver: str | None = None
    python: str | None = None
    git_commit: str | None = None

    def changes_from(self, older: "Fingerprint") -> list[str]:
        return [
            f"{key} {getattr(older, key)} -> {getattr(self, key)}"
            for key in ENV_KEYS
            if getattr(older, key) != getattr(self, key)
        ]


def fingerprint_from_run_json(run_json: dict | None) -> Fingerprint:
    run_json = run_json or {}
    versions = run_json.get("versions") or {}
    names = sorted(set(run_json.get("gpu_names") or []))
    return Fingerprint(
        gpu_model=" + ".join(names) if names else "cpu",
        torch=versions.get("torch"),
        cuda=versions.get("cuda"),
        driver=versions.get("driver"),
        python=versions.get("python"),
        git_commit=run_json.get("git_commit"),
    )


@dataclass(frozen=True)
class Measurement:
    test: str
    outcome: str
    throughput: float | None
    peak_memory: float | None
    wall_time: float | None
    fingerprint: Fingerprint


def throughput_value(raw) -> float | None:
    """The harness reports {"last", "mean"} over a run's rollouts; the mean is steadier."""
    if isinstance(raw, dict):
        raw = raw.get("mean", raw.get("last"))
    return float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None


def measurement_from_result(result: dict) -> Measurement:
    """From the harness's <MILES_RESULTS_DIR>/<case name>.json."""
    return Measurement(
        test=result["name"],
        outcome=result.get("outcome", "unknown"),
        throughput=throughput_value(result.get("throughput")),
        peak_memory=result.get("peak_memory"),
        wall_time=result.get("wall_time"),
        fingerprint=fingerprint_from_run_json(result.get("run_json")),
    )


@dataclass(frozen=True)
class Thresholds:
    throughput_drop: float = 0.10  # fraction of the baseline throughput that may be lost
    memory_rise: float = 0.05  # fraction of the baseline peak memory that may be added
    reason: str = ""


@dataclass
class ThresholdRegistry:
    defaults: Thresholds = field(default_factory=Thresholds)
    per_test: dict[str, Thresholds] = field(default_factory=dict)

    def for_test(self, test: str) -> Thresholds:
        return self.per_test.get(test, self.defaults)


def load_thresholds(path: Path | None) -> ThresholdRegistry:
    """YAML: {defaults: {throughput_drop, memory_rise}, tests: {name: {..., reason}}}."""
    if path is None or not Path(path).exists():
        return ThresholdRegistry()
    data = yaml.safe_load(Path(path).read_text()) or {}
    known = {f.name for f in fields(Thresholds)}
    defaults = Thresholds(**{k: v for k, v in (data.get("defaults") or {}).items() if k in known})
    per_test = {}
    for test, values in (data.get("tests") or {}).items():
        if not (values or {}).get("reason"):
            raise ValueError(f"{path}: the threshold override of {test} needs a reason")
        merged = {**defaults.__dict__, **values}
        per_test[test] = Thresholds(**{k: v for k, v in merged.items() if k in known})
    return ThresholdRegistry(defaults, per_test)


@dataclass
class Verdict:
    test: str
    status: str  # "pass", "fail", "no history" or "not gated"
    messages: list[str] = field(default_factory=list)
    env_changes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def describe(self) -> str:
        parts = list(self.messages)
        if self.env_changes:
            parts.append("environment changed: " + ", ".join(self.env_changes))
        return "; ".join(parts) if parts else self.status


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class History:
    def __init__(self, path: Path, baseline_runs: int = BASELINE_RUNS):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path))
        self.db.row_factory = sqlite3.Row
        self.db.executescript(SCHEMA)
        self.baseline_runs = baseline_runs

    def close(self) -> None:
        self.db.close()

    def record(self, m: Measurement, gate_ok: bool) -> None:
        fp = m.fingerprint
        self.db.execute(
            "INSERT INTO runs (test, recorded_at, outcome, gate_ok, throughput, peak_memory,"
            " wall_time, gpu_model, torch, cuda, driver, python, git_commit)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (m.test, _now(), m.outcome, int(gate_ok), m.throughput, m.peak_memory, m.wall_time,
             fp.gpu_model, fp.torch, fp.cuda, fp.driver, fp.python, fp.git_commit),
        )
        self.db.commit()

    def recent_passing(self, test: str, gpu_model: str) -> list[sqlite3.Row]:
        """Newest first. A run that failed the gate is no baseline: a regression must not
        become the new normal just by repeating for a few nights."""
        return self.db.execute(
            "SELECT * FROM runs WHERE test = ? AND gpu_model = ? AND outcome = 'passed'"
            " AND gate_ok = 1 ORDER BY id DESC LIMIT ?",
            (test, gpu_model, self.baseline_runs),
        ).fetchall()

    def runs(self, test: str | None = None) -> list[sqlite3.Row]:
        if test is None:
            return self.db.execute("SELECT * FROM runs ORDER BY id").fetchall()
        return self.db.execute("SELECT * FROM runs WHERE test = ? ORDER BY id", (test,)).fetchall()

    def check(self, m: Measurement, limits: Thresholds) -> Verdict:
        if m.outcome != "passed":
            return Verdict(m.test, "not gated", [f"test {m.outcome}"])
        if m.throughput is None and m.peak_memory is None:
            return Verdict(m.test, "not gated", ["no throughput or peak memory reported"])
        baseline = self.recent_passing(m.test, m.fingerprint.gpu_model)
        if not baseline:
            return Verdict(m.test, "no history", [f"no history on {m.fingerprint.gpu_model}"])
        verdict = Verdict(m.test, "pass", env_changes=m.fingerprint.changes_from(_row_fp(baseline[0])))
        _compare_throughput(verdict, m, baseline, limits)
        _compare_memory(verdict, m, baseline, limits)
        return verdict

    def gate(self, m: Measurement, limits: Thresholds) -> Verdict:
        """Check, then store the run, so the next night compares against it when it passed."""
        verdict = self.check(m, limits)
        if m.outcome in ("passed", "failed"):
            self.record(m, gate_ok=verdict.ok)
        return verdict


def _row_fp(row: sqlite3.Row) -> Fingerprint:
    return Fingerprint(**{f.name: row[f.name] for f in fields(Fingerprint)})


def _median(rows: list[sqlite3.Row], column: str) -> float | None:
    values = [r[column] for r in rows if r[column] is not None]
    return statistics.median(values) if values else None


def _compare_throughput(verdict: Verdict, m: Measurement, baseline, limits: Thresholds) -> None:
    _compare(verdict, "throughput", m.throughput, baseline, "throughput", lambda v: f"{v:.4g}",
             fails_on="drop", limit=limits.throughput_drop)


def _compare_memory(verdict: Verdict, m: Measurement, baseline, limits: Thresholds) -> None:
    _compare(verdict, "peak memory", m.peak_memory, baseline, "peak_memory", _mib,
             fails_on="rise", limit=limits.memory_rise)


def _compare(verdict: Verdict, label: str, value: float | None, baseline, column: str,
             show: Callable[[float], str], *, fails_on: Literal["drop", "rise"], limit: float) -> None:
    """One measurement against the median of its baseline: a change past `limit` in the
    direction `fails_on` fails the verdict; any change is reported."""
    base = _median(baseline, column)
    if base is None or value is None or base <= 0:
        return
    change = value / base - 1.0
    line = f"{label} {show(value)} vs {show(base)} (median of {len(baseline)}): {change:+.1%}"
    sign = "-" if fails_on == "drop" else "+"
    if (-change if fails_on == "drop" else change) > limit:
        verdict.status = "fail"
        verdict.messages.append(f"{line}, allowed {sign}{limit:.0%}")
    else:
        verdict.messages.append(line)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def _show(history: History, test: str | None) -> None:
    columns = ("id", "recorded_at", "test", "outcome", "gate_ok", "throughput", "peak_memory",
               "wall_time", "gpu_model", "torch", "cuda", "driver")
    print("\t".join(columns))
    for row in history.runs(test):
        print("\t".join("" if row[c] is None else str(row[c]) for c in columns))


def forget(history: History, test: str) -> int:
    """Starts a test's history over, e.g. after an intended change of its speed or memory."""
    deleted = history.db.execute("DELETE FROM runs WHERE test = ?", (test,)).rowcount
    history.db.commit()
    return deleted


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m ci.history",
                                description="Inspect or reset the gate's history.")
    p.add_argument("command", choices=["show", "forget"])
    p.add_argument("--db", type=Path, required=True, help="the SQLite history file")
    p.add_argument("--test", help="one test's runs (required by forget)")
    args = p.parse_args(argv)
    if args.command == "forget" and not args.test:
        p.error("forget needs --test")
    history = History(args.db)
    try:
        if args.command == "show":
            _show(history, args.test)
        else:
            print(f"deleted {forget(history, args.test)} runs of {args.test}")
    finally:
        history.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
