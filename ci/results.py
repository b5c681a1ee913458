"""What one case's run came to, read from its pytest subprocess and the harness's result file."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from ci.history import Verdict, throughput_value

LOG_TAIL_LINES = 60
# the message of a case whose node died under it (Ray mode); it says nothing about the case
NODE_LOST = "node lost"


@dataclass
class CaseResult:
    name: str
    nodeid: str | None
    gpus_needed: int
    est_time: float
    outcome: str = "pending"  # passed, failed, error, skipped, timeout
    message: str = ""
    gpus: tuple[int, ...] = ()
    start: float = 0.0
    wall_time: float = 0.0
    log_path: str | None = None
    log_tail: str = ""
    harness_result: dict | None = None
    verdict: Verdict | None = None
    node: str = ""  # the Ray node it ran on (Ray mode); empty on a single node
    lost_on: tuple[str, ...] = ()  # nodes that died under its attempts (Ray mode)
    lost_tail: str = ""  # the log tail when the last of them died

    @property
    def node_lost(self) -> bool:
        return self.outcome == "error" and self.message.startswith(NODE_LOST)

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "error", "timeout") or (
            self.verdict is not None and not self.verdict.ok)

    @property
    def throughput(self) -> float | None:
        return throughput_value((self.harness_result or {}).get("throughput"))

    @property
    def peak_memory(self) -> float | None:
        return (self.harness_result or {}).get("peak_memory")


def read_harness_result(results_dir: Path, name: str) -> dict | None:
    path = Path(results_dir) / f"{name}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def outcome_from_junit(path: Path) -> tuple[str, str] | None:
    """The outcome pytest itself wrote for the single test of a subprocess."""
    if not Path(path).exists():
        return None
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError:
        return None
    worst = None
    for case in cases:
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                worst = worst or (outcome, node.get("message") or "")
                if outcome in ("failed", "error"):
                    return outcome, node.get("message") or ""
        worst = worst or ("passed", "")
    return worst


def outcome_from_exit_code(code: int) -> tuple[str, str]:
    if code == 0:
        return "passed", ""
    if code == 1:
        return "failed", "pytest reported failures"
    if code == 5:
        return "error", "pytest collected no test for this node id"
    return "error", f"pytest exited with code {code}"


def settle_outcome(result: CaseResult, exit_code: int, junit_path: Path) -> None:
    """Harness result first, then pytest's own JUnit, then the exit code; a crashed or
    interrupted pytest overrides a 'passed' it never got to contradict."""
    harness = (result.harness_result or {}).get("outcome")
    from_junit = outcome_from_junit(junit_path)
    if from_junit is not None:
        result.outcome, result.message = from_junit
    else:
        result.outcome, result.message = outcome_from_exit_code(exit_code)
    if harness in ("failed", "error") and result.outcome == "passed":
        result.outcome = harness
    if exit_code not in (0, 1, 5) and result.outcome in ("passed", "skipped"):
        result.outcome, result.message = outcome_from_exit_code(exit_code)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])
