"""Test cases as the suite runner sees them: the harness's case metadata, filtered."""

from __future__ import annotations

import json
import shlex
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


SUITE_FILE_FIX = ('fix: give a JSON list of cases, each {"name": ..., "gpus": N, "est_time": SECONDS} '
                  '(docs/ci.md), or drop --suite-json to collect the harness\'s cases')


def load_cases(path: Path) -> list[Case]:
    """The cases of a suite file; CollectError (one line with its fix) for one that cannot be used."""
    try:
        entries = json.loads(Path(path).read_text())
    except OSError as err:
        raise CollectError(f"cannot read it ({err.strerror or err}); {SUITE_FILE_FIX}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CollectError(f"not JSON ({err}); {SUITE_FILE_FIX}") from None
    if not isinstance(entries, list):
        raise CollectError(f"holds a JSON {type(entries).__name__}, not a list; {SUITE_FILE_FIX}")
    cases = []
    for i, entry in enumerate(entries):
        try:
            cases.append(case_from_dict(entry))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            why = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
            raise CollectError(f"entry {i} is not a case ({why}); {SUITE_FILE_FIX}") from None
    duplicates = sorted({c.name for c in cases if [d.name for d in cases].count(c.name) > 1})
    if duplicates:
        raise CollectError(f"case names must be unique, repeated: {', '.join(duplicates)}; fix: rename or drop the "
                           f"repeated entries")
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
            raise CollectError(_collect_failed(proc, tests_path))
        return load_cases(out)


def _collect_failed(proc: subprocess.CompletedProcess, tests_path: str) -> str:
    """One line: pytest's last line, its whole output kept in a log file the line names."""
    with tempfile.NamedTemporaryFile("w", prefix="miles-ci-collect-", suffix=".log", delete=False) as log:
        log.write(f"$ {shlex.join(proc.args)}\n{proc.stdout}{proc.stderr}")
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return (f"collecting the cases under {tests_path} failed (pytest exit {proc.returncode}: "
            f"{lines[-1] if lines else 'no output'}); fix: the collection error in {log.name} (pytest's whole "
            f"output), or point --tests at the harness's cases")


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
