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
    achieved_makespan: float | None = None  # first start to last end, from the run's clock
    cluster: str | None = None  # the Ray cluster the cases ran on; None: this node's GPUs


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
    lost = sum(r.node_lost for r in results)
    state = f"FAILED ({len(bad)} of {len(results)})" if bad else "passed"
    if lost:
        state = state[:-1] + f"; {lost} lost with their node)"
    return f"## Suite `{facts.suite}`: {state}"


def _makespan_line(facts: RunFacts) -> str:
    def ratio(value: float) -> str:
        return f"ratio {value / facts.lower_bound:.3f}" if facts.lower_bound else "ratio -"

    pool = list(map(str, facts.gpu_pool))
    devices = list(dict.fromkeys(pool))
    shares = f" in {len(pool)} shares" if len(pool) > len(devices) else ""  # --gpu-shares
    where = f"Ray cluster {facts.cluster}" if facts.cluster else (
        "GPUs " + (",".join(devices) or "none") + shares)
    line = (f"{where}. Planned makespan {duration(facts.planned_makespan)} against a lower bound"
            f" of {duration(facts.lower_bound)} ({ratio(facts.planned_makespan)})")
    if facts.achieved_makespan is not None:
        line += (f"; achieved makespan {duration(facts.achieved_makespan)} "
                 f"({facts.achieved_makespan:.1f}s, {ratio(facts.achieved_makespan)})")
    return line + f"; actual wall time {duration(facts.wall_time)}."


def _lost_line(results: Sequence[CaseResult]) -> list[str]:
    lost = [r for r in results if r.lost_on]
    if not lost:
        return []
    nodes = sorted({node for r in lost for node in r.lost_on})
    rerun = sum(not r.node_lost for r in lost)
    return [f"Nodes lost: {', '.join(nodes)}; {len(lost)} cases lost with them, {rerun} rerun "
            f"elsewhere, {len(lost) - rerun} not rerun."]


def _overview(facts: RunFacts, results: Sequence[CaseResult]) -> list[str]:
    counts = {k: sum(r.outcome == k for r in results) for k in ICONS}
    gate_failures = sum(r.verdict is not None and not r.verdict.ok for r in results)
    return [
        " · ".join(f"{ICONS[k]} {k} {v}" for k, v in counts.items() if v)
        + f" · gate failures {gate_failures}",
        "",
        _makespan_line(facts),
        f"Gate: {'history in ' + facts.gate_db if facts.gate_db else 'off (no --history-db)'}.",
    ] + _lost_line(results)


def _table(results: Sequence[CaseResult]) -> list[str]:
    with_node = any(r.node for r in results)
    node_head, node_rule = ("| node ", "|---") if with_node else ("", "")
    lines = [f"| test {node_head}| GPUs | outcome | wall | estimate | throughput | peak memory | gate |",
             f"|---{node_rule}|---|---|---|---|---|---|---|"]
    for r in results:
        gpus = ",".join(map(str, r.gpus)) if r.gpus else ("cpu" if r.gpus_needed == 0 else "-")
        node = f"| {r.node or '-'} " if with_node else ""
        rerun = " (rerun: node lost)" if r.lost_on and not r.node_lost else ""
        lines.append(
            f"| `{r.name}` {node}| {gpus} | {ICONS.get(r.outcome, '')} {r.outcome}{rerun} "
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


def _reruns(results: Sequence[CaseResult]) -> list[str]:
    lines = []
    for r in results:
        if not r.lost_on or r.node_lost:
            continue
        lines += ["<details>", f"<summary><code>{html.escape(r.name)}</code>: lost with node "
                  f"{html.escape(', '.join(r.lost_on))}, rerun: {r.outcome}</summary>", "",
                  f"log (all attempts): `{r.log_path}`", "", "```",
                  r.lost_tail.replace("```", "'''"), "```", "</details>", ""]
    return (["### Rerun after their node was lost", ""] + lines) if lines else []


def _skips(results: Sequence[CaseResult]) -> list[str]:
    lines = [f"- `{r.name}`: {r.message or 'no reason given'}" for r in results
             if r.outcome == "skipped"]
    return (["### Skipped", ""] + lines + [""]) if lines else []


def render(facts: RunFacts, results: Sequence[CaseResult]) -> str:
    parts = [_headline(facts, results), ""] + _overview(facts, results) + [""]
    parts += _table(results) + [""] + _failures(results) + _reruns(results) + _skips(results)
    return "\n".join(parts).rstrip() + "\n"


def write_summary(path: Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as out:
            out.write(text + "\n")
