"""Metric standards: the committed series a run's registered metrics must reproduce.

`tests/e2e/standards/<case name>.json` holds, per registered metric, the value at every
rollout, and the fingerprint of the environment it was recorded in (`miles.utils.numerics`).
Standards are written only by an explicit `pytest ... --miles-record-standards`.

The cross-environment policy (docs/testing.md): a run whose fingerprint equals the standard's
compares its series strictly (`==`, or a registered `Tolerance`); a run whose fingerprint
differs is told, first, exactly what differs, its strict series are not compared, and it must
still show what holds anywhere: its registered learning signals and tolerances (the run
invariants, parity 0.0 and finite values, are checked for every run before this).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from miles.testing.cases import RecipeCase, Tolerance, command_line_id
from miles.utils.numerics import fingerprint_changes

STANDARD_VERSION = 2


def standard_path(standards_dir: str | Path, case: RecipeCase) -> Path:
    return Path(standards_dir) / f"{case.name}.json"


def record_command(nodeid: str) -> str:
    import shlex

    return f"pytest {shlex.quote(command_line_id(nodeid))} --miles-record-standards"


def _env_of(run_json: Mapping | None) -> dict:
    if not run_json:
        return {}
    keep = ("versions", "gpu_names", "git_commit", "hostname", "machine")
    return {k: run_json[k] for k in keep if k in run_json}


def build_standard(case: RecipeCase, metrics: Sequence[Mapping], run_json: Mapping | None = None) -> dict:
    series = {}
    for key in case.metrics:
        series[key] = [row.get(key) for row in metrics]
    return {
        "version": STANDARD_VERSION,
        "case": case.name,
        "recipe": case.script,
        "args": list(case.args),
        "rollout_ids": [row.get("rollout_id") for row in metrics],
        "metrics": series,
        "fingerprint": (run_json or {}).get("fingerprint"),
        "recorded_on": _env_of(run_json),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def constant_series(standard: Mapping) -> list[str]:
    """Registered series of a standard that pin nothing: every value equal (all zeros included).
    A standard with one is refused when recorded and fails the standards' own test."""
    problems = []
    for key, values in (standard.get("metrics") or {}).items():
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) < 2 or len(set(numbers)) == 1:
            problems.append(f"{key} is constant {values!r}: it compares nothing (make the case produce a "
                            "signal, or stop registering the metric)")
    return problems


def write_standard(path: str | Path, standard: Mapping) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(standard, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_standard(path: str | Path) -> dict | None:
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Mismatch:
    metric: str
    index: int
    rollout_id: object
    actual: object
    expected: object
    tolerance: Tolerance | None

    def __str__(self) -> str:
        how = "strict" if self.tolerance is None else (
            f"tolerance abs={self.tolerance.abs:g} rel={self.tolerance.rel:g}")
        diff = ""
        if isinstance(self.actual, (int, float)) and isinstance(self.expected, (int, float)):
            diff = f" (diff {self.actual - self.expected:+.3e})"
        return (f"{self.metric} at rollout {self.rollout_id}: got {self.actual!r}, "
                f"standard {self.expected!r}{diff} [{how}]")


def _equal(actual, expected, tol: Tolerance | None) -> bool:
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if math.isnan(actual) or math.isnan(expected):
            return False
        if tol is None:
            return actual == expected
        return tol.allows(actual, expected)
    return actual == expected


def compare_to_standard(case: RecipeCase, metrics: Sequence[Mapping], standard: Mapping) -> list[str]:
    """Problems (empty = equal) between a run's metrics and the standard, per registered metric."""
    problems: list[str] = []
    expected_series: Mapping = standard.get("metrics", {})
    rollout_ids = [row.get("rollout_id") for row in metrics]
    for key in case.metrics:
        if key not in expected_series:
            problems.append(f"{key}: registered for comparison but absent from the standard "
                            "(re-record the standard)")
            continue
        expected = list(expected_series[key])
        actual = [row.get(key) for row in metrics]
        if len(actual) != len(expected):
            problems.append(f"{key}: {len(actual)} values, the standard has {len(expected)}")
            continue
        tol = case.tolerances.get(key)
        for i, (a, e) in enumerate(zip(actual, expected)):
            if not _equal(a, e, tol):
                problems.append(str(Mismatch(key, i, rollout_ids[i], a, e, tol)))
    return problems


@dataclass
class Verdict:
    """The outcome of comparing a run with its standard under the cross-environment policy."""

    env_changes: list[str]  # empty: same fingerprint, strict comparison
    problems: list[str]

    @property
    def strict(self) -> bool:
        return not self.env_changes

    def headline(self) -> str:
        if self.strict:
            return "same environment as the standard: series compared strictly"
        return ("environment differs from the standard's: " + "; ".join(self.env_changes)
                + " -- strict series not compared; learning signals and tolerances asserted")


def signal_problems(case: RecipeCase, metrics: Sequence[Mapping]) -> list[str]:
    problems = []
    for signal in case.signals:
        problem = signal.problem([row.get(signal.metric) for row in metrics])
        if problem:
            problems.append(problem)
    return problems


def judge(case: RecipeCase, metrics: Sequence[Mapping], run_json: Mapping | None, standard: Mapping) -> Verdict:
    """Same fingerprint: every registered series against the standard, plus the signals.
    Different fingerprint: what changed, the signals, and the series that have a registered
    tolerance (a tolerance is a claim about spread, which holds across environments too)."""
    changes = fingerprint_changes(standard.get("fingerprint"), (run_json or {}).get("fingerprint"))
    problems = signal_problems(case, metrics)
    if changes:
        portable = case.with_(metrics=tuple(case.tolerances), name=case.name) if case.tolerances else None
        if portable is not None:
            problems += compare_to_standard(portable, metrics, standard)
    else:
        problems += compare_to_standard(case, metrics, standard)
    return Verdict(changes, problems)
