"""The Markdown summary of a suite run, written for a CI job summary page."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ci.results import CaseResult

ICONS = {"passed": "✅", "failed": "❌", "error": "💥", "timeout": "⏱️", "skipped": "⏭️"}


@dataclass
class RunFacts:
    suite: str
    gpu_pool: tuple[int, ...]
    planned_makespan: float
    lower_bound: float
    wall_time: float
    gate_db: str | None


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "MiB":
        return f"{value / 2**20:.0f} MiB"
    return f"{value:.4g}"


def _gate_cell(result: CaseResult) -> str:
    if result.verdict is None:
        return "-"
    if not result.verdict.ok:
        return "❌ " + result.verdict.describe()
    if result.verdict.env_changes:
        return "⚠️ " + result.verdict.describe()
    return result.verdict.status


def _headline(facts: RunFacts, results: Sequence[CaseResult]) -> str:
    bad = [r for r in results if r.failed]
    state = f"FAILED ({len(bad)} of {len(results)})" if bad else "passed"
    return f"## Suite `{facts.suite}`: {state}"


def _overview(facts: RunFacts, results: Sequence[CaseResult]) -> list[str]:
    counts = {k: sum(r.outcome == k for r in results) for k in ICONS}
    gate_failures = sum(r.verdict is not None and not r.verdict.ok for r in results)
    ratio = facts.planned_makespan / facts.lower_bound if facts.lower_bound else 1.0
    gpus = ",".join(map(str, facts.gpu_pool)) or "none"
    return [
        " · ".join(f"{ICONS[k]} {k} {v}" for k, v in counts.items() if v)
        + f" · gate failures {gate_failures}",
        "",
        f"GPUs {gpus}. Planned makespan {duration(facts.planned_makespan)} against a lower bound"
        f" of {duration(facts.lower_bound)} (ratio {ratio:.3f}); actual wall time"
        f" {duration(facts.wall_time)}.",
        f"Gate: {'history in ' + facts.gate_db if facts.gate_db else 'off (no --history-db)'}.",
    ]


def _table(results: Sequence[CaseResult]) -> list[str]:
    lines = ["| test | GPUs | outcome | wall | estimate | throughput | peak memory | gate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        gpus = ",".join(map(str, r.gpus)) if r.gpus else ("cpu" if r.gpus_needed == 0 else "-")
        lines.append(
            f"| `{r.name}` | {gpus} | {ICONS.get(r.outcome, '')} {r.outcome} "
            f"| {duration(r.wall_time)} | {duration(r.est_time)} | {_number(r.throughput)} "
            f"| {_number(r.peak_memory, 'MiB')} | {_gate_cell(r)} |")
    return lines


def _failures(results: Sequence[CaseResult]) -> list[str]:
    lines = []
    for r in results:
        if not r.failed:
            continue
        reason = r.verdict.describe() if r.outcome == "passed" and r.verdict else r.message
        reason = (reason or r.outcome).splitlines()[0]
        lines += ["<details>", f"<summary><code>{html.escape(r.name)}</code>: {html.escape(reason)}</summary>",
                  "", f"log: `{r.log_path}`", "", "```", r.log_tail.replace("```", "'''"),
                  "```", "</details>", ""]
    return (["### Failures", ""] + lines) if lines else []


def _skips(results: Sequence[CaseResult]) -> list[str]:
    lines = [f"- `{r.name}`: {r.message or 'no reason given'}" for r in results
             if r.outcome == "skipped"]
    return (["### Skipped", ""] + lines + [""]) if lines else []


def render(facts: RunFacts, results: Sequence[CaseResult]) -> str:
    parts = [_headline(facts, results), ""] + _overview(facts, results) + [""]
    parts += _table(results) + [""] + _failures(results) + _skips(results)
    return "\n".join(parts).rstrip() + "\n"


def write_summary(path: Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as out:
            out.write(text + "\n")
