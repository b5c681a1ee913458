"""JUnit XML for a suite run, in the shape CI test reporters read."""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from ci.results import CaseResult

# XML 1.0 forbids most control characters; a log tail can hold any of them
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _clean(text: str) -> str:
    return _NOT_XML.sub("?", text or "")


def _testcase(suite: str, result: CaseResult) -> ET.Element:
    node = ET.Element("testcase", {
        "classname": f"ci.{suite}",
        "name": result.name,
        "time": f"{result.wall_time:.3f}",
    })
    if result.nodeid:
        node.set("file", result.nodeid.split("::")[0])
    if result.outcome in ("failed", "timeout"):
        failure = ET.SubElement(node, "failure", {"message": _clean(result.message or result.outcome),
                                                  "type": result.outcome})
        failure.text = _clean(result.log_tail)
    elif result.outcome == "error":
        error = ET.SubElement(node, "error", {"message": _clean(result.message or "error")})
        error.text = _clean(result.log_tail)
    elif result.outcome == "skipped":
        ET.SubElement(node, "skipped", {"message": _clean(result.message)})
    elif result.verdict is not None and not result.verdict.ok:
        failure = ET.SubElement(node, "failure", {"message": _clean(result.verdict.describe()),
                                                  "type": "gate"})
        failure.text = _clean(result.verdict.describe())
    props = ET.SubElement(node, "properties")
    for key, value in _properties(result).items():
        ET.SubElement(props, "property", {"name": key, "value": _clean(str(value))})
    if result.log_path:
        ET.SubElement(node, "system-out").text = f"log: {result.log_path}"
    return node


def _properties(result: CaseResult) -> dict:
    props = {"gpus": ",".join(map(str, result.gpus)), "est_time": result.est_time}
    if result.throughput is not None:
        props["throughput"] = result.throughput
    if result.peak_memory is not None:
        props["peak_memory"] = result.peak_memory
    if result.verdict is not None:
        props["gate"] = result.verdict.describe()
    if result.node:
        props["node"] = result.node
    if result.lost_on:
        props["lost_on"] = ", ".join(result.lost_on)
    return props


def _counts(results: Sequence[CaseResult]) -> dict[str, int]:
    def gate_failed(r: CaseResult) -> bool:
        return r.outcome == "passed" and r.verdict is not None and not r.verdict.ok

    return {
        "tests": len(results),
        "failures": sum(r.outcome in ("failed", "timeout") or gate_failed(r) for r in results),
        "errors": sum(r.outcome == "error" for r in results),
        "skipped": sum(r.outcome == "skipped" for r in results),
    }


def write_junit(path: Path, suite: str, results: Sequence[CaseResult], wall_time: float) -> None:
    counts = {k: str(v) for k, v in _counts(results).items()}
    root = ET.Element("testsuites", {**counts, "time": f"{wall_time:.3f}"})
    suite_node = ET.SubElement(root, "testsuite", {
        "name": suite, **counts, "time": f"{wall_time:.3f}",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    })
    for result in results:
        suite_node.append(_testcase(suite, result))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
