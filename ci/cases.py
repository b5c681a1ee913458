"""Test cases as the suite runner sees them: the harness's case metadata, filtered."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ci.scheduler import Job

DEFAULT_TIMEOUT = 3600.0
# how a multi-node case's per-node bundles are placed (Ray placement group strategies)
PLACEMENTS = ("STRICT_SPREAD", "SPREAD", "STRICT_PACK", "PACK")
# in a case's command, replaced by the Python that runs it (the runner's, or a Ray worker's)
PYTHON = "{python}"


@dataclass(frozen=True)
class Case:
    name: str
    gpus: int
    est_time: float
    nodeid: str | None = None
    tier: str = "gpu"
    timeout: float = DEFAULT_TIMEOUT
    recipe: str | None = None
    suites: tuple[str, ...] | None = None  # None: a synthetic case, in every suite
    labels: tuple[str, ...] = ()
    # a command instead of `pytest <nodeid>` (synthetic suites); "{python}" is the interpreter
    command: tuple[str, ...] | None = None
    # spread over this many nodes, gpus // nodes on each (Ray mode only)
    nodes: int = 1
    placement: str = "STRICT_SPREAD"
    # peak GPU memory of a one-GPU case: with --gpu-shares it shares a device (ci/gpu_shares.py)
    gpu_memory_gib: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus % self.nodes:
            raise ValueError(f"{self.name}: {self.gpus} GPUs do not split evenly over {self.nodes} nodes")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{self.name}: placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def job(self) -> Job:
        return Job(self.name, self.gpus, self.est_time)

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def runnable(self) -> bool:
        return bool(self.nodeid or self.command)


class CollectError(RuntimeError):
    pass


def case_from_dict(entry: dict) -> Case:
    """Harness metadata and synthetic suites ({"name", "gpus", "est_time"}) alike; a synthetic
    case may carry a `command` (argv) to run instead of pytest, and a multi-node case `nodes`
    (its `gpus` split evenly over them) and `placement` (a Ray placement group strategy); a
    one-GPU case its peak `gpu_memory_gib` (packed by memory under --gpu-shares)."""
    gpus = int(entry.get("gpus") or 0)
    timeout = entry.get("timeout") or DEFAULT_TIMEOUT
    est_time = entry.get("est_time") or timeout
    return Case(
        name=str(entry["name"]),
        gpus=gpus,
        est_time=float(est_time),
        nodeid=entry.get("nodeid"),
        tier=entry.get("tier") or ("gpu" if gpus else "cpu"),
        timeout=float(timeout),
        recipe=entry.get("recipe"),
        suites=tuple(entry["suites"]) if entry.get("suites") is not None else None,
        labels=tuple(entry.get("labels") or ()),
        command=tuple(entry["command"]) if entry.get("command") else None,
        nodes=int(entry.get("nodes") or 1),
        placement=str(entry.get("placement") or "STRICT_SPREAD").upper(),
        gpu_memory_gib=float(entry["gpu_memory_gib"]) if entry.get("gpu_memory_gib") is not None else None,
    )


def load_cases(path: Path) -> list[Case]:
    entries = json.loads(Path(path).read_text())
    cases = [case_from_dict(e) for e in entries]
    duplicates = sorted({c.name for c in cases if [d.name for d in cases].count(c.name) > 1})
    if duplicates:
        raise CollectError(f"case names must be unique, repeated: {', '.join(duplicates)}")
    return cases


def collect_cases(tests_path: str, workdir: Path) -> list[Case]:
    """Asks the harness for its cases: pytest --collect-only --miles-cases-json FILE.

    Exit code 1 is accepted: plugins such as syrupy report unused snapshots that way even when
    only collecting. A collection error (2) is not: the suite would silently lose cases."""
    with tempfile.TemporaryDirectory(prefix="miles-ci-") as tmp:
        out = Path(tmp) / "cases.json"
        cmd = [sys.executable, "-m", "pytest", tests_path, "--collect-only", "-q",
               "-p", "no:cacheprovider", "--miles-rehearsal", "--miles-cases-json", str(out)]
        proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
        if proc.returncode not in (0, 1) or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise CollectError(f"collecting cases failed (exit {proc.returncode}): "
                               f"{' '.join(cmd)}\n{tail}")
        return load_cases(out)


@dataclass
class Selection:
    suite: str | None = None
    tiers: Iterable[str] = field(default_factory=tuple)
    labels: Iterable[str] = field(default_factory=tuple)
    names: Iterable[str] = field(default_factory=tuple)

    def matches(self, case: Case) -> bool:
        if self.names and case.name not in set(self.names):
            return False
        if self.suite and case.suites is not None and self.suite not in case.suites:
            return False
        if self.tiers and case.tier not in set(self.tiers):
            return False
        return set(self.labels) <= set(case.labels)


def select(cases: Iterable[Case], selection: Selection) -> list[Case]:
    return [c for c in cases if selection.matches(c)]
