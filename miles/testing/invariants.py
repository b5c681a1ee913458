"""Invariants every real run must keep, read from its `metrics.jsonl` and `run.json`.

- parity: `train/model_output_mean_abs_diff` (and the max and log-prob diffs when logged) is
  exactly 0.0 at every rollout — never a tolerance;
- rollout ids are contiguous from the start id;
- a fresh run starts at rollout 0 and its run.json says it was not resumed;
- no NaN or inf in any metric;
- registered metrics equal the committed standard (see `miles.testing.standards`).

Each check returns a list of problems (empty = fine); `check_run` gathers them all so one
failure report lists every broken invariant at once.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

PARITY_KEYS = (
    "train/model_output_mean_abs_diff",
    "train/model_output_max_abs_diff",
    "train/log_prob_abs_diff",
)
PRIMARY_PARITY_KEY = PARITY_KEYS[0]


def check_parity(metrics: Sequence[Mapping], required: bool = True) -> list[str]:
    problems = []
    if required and metrics and not any(PRIMARY_PARITY_KEY in row for row in metrics):
        problems.append(f"parity probe missing: no rollout logged {PRIMARY_PARITY_KEY} "
                        "(the run needs --diffusion-debug-mode)")
    for row in metrics:
        rid = row.get("rollout_id")
        if required and PRIMARY_PARITY_KEY not in row:
            problems.append(f"parity probe missing at rollout {rid}")
        for key in PARITY_KEYS:
            if key in row and row[key] != 0.0:
                problems.append(f"parity broken at rollout {rid}: {key} = {row[key]!r} (must be exactly 0.0)")
    return problems


def check_rollout_ids(metrics: Sequence[Mapping], start: int = 0) -> list[str]:
    ids = [row.get("rollout_id") for row in metrics]
    if not ids:
        return ["metrics.jsonl has no rollouts"]
    expected = list(range(start, start + len(ids)))
    if ids != expected:
        return [f"rollout ids {ids} are not contiguous from {start} (expected {expected})"]
    return []


def check_fresh(metrics: Sequence[Mapping], run_json: Mapping | None) -> list[str]:
    problems = []
    if run_json is None:
        return ["run.json is missing: cannot tell a fresh run from a resumed one"]
    if run_json.get("resumed") is not False:
        problems.append(f"run.json says resumed={run_json.get('resumed')!r}; a fresh run must say false")
    start = run_json.get("start_rollout_id")
    if start != 0:
        problems.append(f"run.json start_rollout_id={start!r}; a fresh run starts at 0")
    if metrics and metrics[0].get("rollout_id") != 0:
        problems.append(f"first logged rollout is {metrics[0].get('rollout_id')!r}, a fresh run starts at 0")
    return problems


def _walk(value, path: str):
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def check_finite(metrics: Sequence[Mapping]) -> list[str]:
    problems = []
    for row in metrics:
        rid = row.get("rollout_id")
        for key, value in _walk(row, ""):
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{key} = {value} at rollout {rid}")
            elif isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity"):
                problems.append(f"{key} = {value!r} at rollout {rid}")
    return problems


def check_run(
    metrics: Sequence[Mapping],
    run_json: Mapping | None,
    *,
    parity: bool = True,
    expect_fresh: bool = True,
    expected_rollouts: int | None = None,
) -> list[str]:
    """Every invariant at once, as "<invariant>: <problem>" lines."""
    problems: list[str] = []
    problems += [f"parity: {p}" for p in check_parity(metrics, required=parity)]
    start = 0 if expect_fresh else int((run_json or {}).get("start_rollout_id") or 0)
    problems += [f"rollout ids: {p}" for p in check_rollout_ids(metrics, start)]
    if expect_fresh:
        problems += [f"fresh run: {p}" for p in check_fresh(metrics, run_json)]
    problems += [f"finite: {p}" for p in check_finite(metrics)]
    if expected_rollouts is not None and len(metrics) != expected_rollouts:
        problems.append(f"rollouts: {len(metrics)} logged, expected {expected_rollouts}")
    return problems
