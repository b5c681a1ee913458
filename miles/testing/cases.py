"""Recipe cases: what to run, on which tier, and how long it may take.

A `RecipeCase` names a recipe script plus the arguments, environment and resources of one way
of running it. Test modules list cases and hand them to `parametrize_cases`, which gives every
case a pytest id starting with the recipe's file stem (so `pytest -k wan22` selects by recipe)
and the markers of its tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest

TIERS = ("dry", "cpu", "gpu")

# What each tier defaults to: (args, timeout seconds, estimated seconds, suites).
CPU_PROXY_ARGS = ("--scale", "cpu-proxy", "--num-rollout", "2")
# a GPU case's configuration on CPU slots (`RecipeCase.rehearsal`): its parity must read exactly 0.0,
# and a run that reads otherwise stops there, naming the tensors that differed
STOP_ON_PARITY_DRIFT = ("--extra-args", "--stop-on-parity-drift")
REHEARSAL_ARGS = ("--scale", "cpu-rehearsal", "--num-rollout", "2") + STOP_ON_PARITY_DRIFT
REHEARSAL = "rehearsal"  # the variant, marker and -k word of the rehearsal cases
NIGHTLY_CPU = "nightly-cpu"  # the suite that runs every rehearsal case
# Ray's placement-group strategies, for a case whose GPUs span several nodes of a cluster
PLACEMENTS = ("STRICT_SPREAD", "SPREAD", "STRICT_PACK", "PACK")
# Under `pytest -n N --dist loadgroup` (the project's addopts) the CPU tier's real runs share one
# xdist worker, one after another, while the other workers take the rest of the suite test by test.
# A run is half a dozen busy processes; two side by side on a 2-core machine only slow each other.
# Left to xdist's `load` chunks they all fell to one worker anyway, and the other ran out of tests
# 116 s before it (a 548 s suite).
RECIPE_RUNS_GROUP = "recipe-runs"


def command_line_id(nodeid: str) -> str:
    """`nodeid` as a command line selects it: without the `@<group>` that loadgroup appends."""
    group_at, params_end = nodeid.rfind("@"), nodeid.rfind("]")
    return nodeid[:group_at] if group_at > params_end else nodeid

_TIER_DEFAULTS = {
    "dry": ((), 120.0, 2.0, ("cpu",)),
    "cpu": (CPU_PROXY_ARGS, 600.0, 90.0, ("cpu",)),
    "gpu": ((), 3600.0, 900.0, ("nightly-gpu",)),
}

# pytest-timeout must not fire before the harness's own timeout has ended the run and written
# its report, so cases get this much slack on top of their own limit.
PYTEST_TIMEOUT_SLACK = 120.0


@dataclass(frozen=True)
class Tolerance:
    """How far a metric may drift from its committed standard, and why that is acceptable."""

    reason: str
    abs: float = 0.0
    rel: float = 0.0

    def __post_init__(self) -> None:
        if not self.reason or not self.reason.strip():
            raise ValueError("a Tolerance needs a reason: say what spread was measured and where")
        if self.abs < 0 or self.rel < 0:
            raise ValueError("tolerances are non-negative")

    def allows(self, actual: float, expected: float) -> bool:
        return abs(actual - expected) <= self.abs + self.rel * abs(expected)


SIGNAL_KINDS = ("rises", "falls", "positive")


@dataclass(frozen=True)
class Signal:
    """What shows a run learned, on any machine: `rises` (last value above the first), `falls`
    (below), `positive` (above zero at every rollout, e.g. a gradient norm where two rollouts
    are too few for a trend). Asserted on every run, whatever its environment."""

    metric: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"Signal kind must be one of {SIGNAL_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.metric} {self.kind}"

    def problem(self, series: Sequence[object]) -> str | None:
        """None when the series shows the signal, else what is missing."""
        values = [v for v in series if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(values) != len(series) or not values:
            return f"learning signal '{self}': no numeric series (got {list(series)!r})"
        if self.kind == "positive":
            bad = [i for i, v in enumerate(values) if not v > 0]
            return None if not bad else f"learning signal '{self}': not above 0 at index {bad} ({values})"
        if len(values) < 2:
            return f"learning signal '{self}': needs at least two rollouts, got {values}"
        first, last = values[0], values[-1]
        ok = last > first if self.kind == "rises" else last < first
        return None if ok else f"learning signal '{self}': {first!r} -> {last!r}"


@dataclass(frozen=True)
class RecipeCase:
    """One way of running one recipe.

    script: the recipe, relative to the repository root (or absolute).
    args: script options (`--scale cpu-proxy`, `--num-rollout 2`, `--extra-args ...`).
    env: extra environment for the recipe process.
    gpus: GPUs leased for the run (0 for the dry and CPU tiers).
    timeout: seconds before the harness ends the run.
    metrics: metric keys of metrics.jsonl compared with the committed standard.
    tolerances: per-metric `Tolerance` (with its reason); metrics without one compare strictly.
    tier: "dry", "cpu" or "gpu".
    suites: CI suites the case belongs to ("cpu", "nightly-gpu").
    est_time: expected wall time in seconds (the CI scheduler packs by it).
    labels: free-form tags for selection in CI.
    variant: distinguishes several cases of one recipe on the same tier.
    parity: whether the run must log the train/rollout parity probe (exactly 0.0).
    signals: `Signal`s the run must show on any machine (asserted even when the environment
        differs from the standard's and the strict series are not compared).
    ray_nodes: 0 = one node (see own_head); N >= 1 = the harness builds an N-node cluster on
        loopback for this run and runs the recipe against it with MILES_SCRIPT_EXTERNAL_RAY=1.
    gpu_nodes: GPU tier on a Ray cluster (`ci/run_suite.py --ray-address`): the nodes the case's
        GPUs are spread over, `gpus // gpu_nodes` on each (one placement-group bundle per node).
    placement: how those bundles are placed: STRICT_SPREAD (default: one per distinct node),
        SPREAD, STRICT_PACK or PACK (Ray's placement-group strategies).
    own_head: with ray_nodes=0, whether the recipe starts its own Ray head through the full
        launcher path. CPU-tier cases default to False: they run, one after another, against a
        one-node cluster their pytest(-xdist) worker starts once (external-Ray mode; each run
        still its own job, output dir and token), which saves a head start per case. GPU-tier
        cases always start their own head (the leased GPUs are fixed at `ray start`).
    root: repository root the script is relative to (None = found from pytest's rootdir).
    """

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0
    timeout: float = 600.0
    metrics: tuple[str, ...] = ()
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    tier: str = "cpu"
    suites: tuple[str, ...] = ("cpu",)
    est_time: float = 60.0
    labels: tuple[str, ...] = ()
    variant: str = ""
    parity: bool = True
    signals: tuple[Signal, ...] = ()
    ray_nodes: int = 0
    own_head: bool = False
    gpu_nodes: int = 1
    placement: str = "STRICT_SPREAD"
    name: str = ""
    root: Path | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if self.tier == "gpu" and self.gpus < 1:
            raise ValueError(f"{self.script}: a GPU-tier case needs gpus >= 1")
        if self.tier != "gpu" and self.gpus:
            raise ValueError(f"{self.script}: only GPU-tier cases lease GPUs (tier {self.tier!r})")
        if self.gpu_nodes < 1 or self.gpus % self.gpu_nodes or (self.gpu_nodes > 1 and self.tier != "gpu"):
            raise ValueError(f"{self.script}: gpu_nodes={self.gpu_nodes} must divide the GPU tier's gpus={self.gpus}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{self.script}: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        unknown = set(self.tolerances) - set(self.metrics)
        if unknown:
            raise ValueError(f"{self.script}: tolerances for metrics not compared: {sorted(unknown)}")
        for key, tol in self.tolerances.items():
            if not isinstance(tol, Tolerance):
                raise TypeError(f"{self.script}: tolerance of {key!r} must be a Tolerance with a reason")
        # Normalise sequences so cases hash and compare by value.
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "metrics", tuple(self.metrics))
        object.__setattr__(self, "suites", tuple(self.suites))
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "signals", tuple(self.signals))
        for signal in self.signals:
            if not isinstance(signal, Signal):
                raise TypeError(f"{self.script}: signals must be Signal(metric, kind), got {signal!r}")
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "tolerances", dict(self.tolerances))
        if not self.name:
            parts = [self.stem, self.tier] + ([self.variant] if self.variant else [])
            object.__setattr__(self, "name", "-".join(parts))

    def __hash__(self) -> int:
        return hash((self.name, self.script, self.args))

    # -- constructors for the three tiers ------------------------------------------------
    @classmethod
    def _tier(cls, tier: str, script: str | Path, **kw) -> "RecipeCase":
        args, timeout, est, suites = _TIER_DEFAULTS[tier]
        kw.setdefault("args", args)
        kw.setdefault("timeout", timeout)
        kw.setdefault("est_time", est)
        kw.setdefault("suites", suites)
        return cls(script=str(script), tier=tier, **kw)

    @classmethod
    def dry(cls, script: str | Path, **kw) -> "RecipeCase":
        """The recipe as a user runs it, with submission off: argv snapshot and static checks."""
        kw.setdefault("parity", False)
        return cls._tier("dry", script, **kw)

    @classmethod
    def cpu(cls, script: str | Path, **kw) -> "RecipeCase":
        """The recipe's CPU proxy (`--scale cpu-proxy --num-rollout 2` unless args say otherwise)."""
        return cls._tier("cpu", script, **kw)

    @classmethod
    def rehearsal(cls, script: str | Path, *, in_default_run: bool = False, **kw) -> "RecipeCase":
        """The recipe's GPU configuration on CPU slots (`--scale cpu-rehearsal` unless args say
        otherwise): a CPU-tier case of variant `rehearsal`, marked `rehearsal`, in the nightly CPU
        suite; `in_default_run`: also in the README's test command (suite `cpu`)."""
        kw.setdefault("args", REHEARSAL_ARGS)
        kw.setdefault("variant", REHEARSAL)
        kw.setdefault("suites", (("cpu",) if in_default_run else ()) + (NIGHTLY_CPU,))
        return cls._tier("cpu", script, **kw)

    @property
    def is_rehearsal(self) -> bool:
        return self.variant.startswith(REHEARSAL)

    @classmethod
    def gpu(cls, script: str | Path, gpus: int, **kw) -> "RecipeCase":
        """The recipe (or its documented GPU proxy) on `gpus` leased GPUs; nightly."""
        return cls._tier("gpu", script, gpus=gpus, **kw)

    # -- derived facts -------------------------------------------------------------------
    @property
    def uses_shared_cluster(self) -> bool:
        return self.tier == "cpu" and self.ray_nodes == 0 and not self.own_head

    @property
    def stem(self) -> str:
        return Path(self.script).stem

    @property
    def id(self) -> str:
        return self.name

    def with_(self, **changes) -> "RecipeCase":
        changes.setdefault("name", "")
        return replace(self, **changes)

    def script_path(self, rootdir: Path | None = None) -> Path:
        """The recipe's absolute path: `root` if the case has one, else looked up from `rootdir`
        and its parents (so a run from a sub-directory still finds `scripts/`)."""
        p = Path(self.script)
        if p.is_absolute():
            return p
        if self.root is not None:
            return Path(self.root) / p
        start = Path(rootdir or Path.cwd()).resolve()
        for base in (start, *start.parents):
            if (base / p).exists():
                return base / p
        return start / p

    def repo_root(self, rootdir: Path | None = None) -> Path:
        """Directory the recipe runs from: the one holding `scripts/`."""
        path = self.script_path(rootdir)
        rel_parts = len(Path(self.script).parts) if not Path(self.script).is_absolute() else 2
        return path.parents[rel_parts - 1]

    def pytest_timeout(self) -> float:
        return self.timeout + PYTEST_TIMEOUT_SLACK

    def marks(self) -> list[pytest.MarkDecorator]:
        marks = [pytest.mark.e2e, pytest.mark.timeout(self.pytest_timeout())]
        if self.tier == "dry":
            marks.append(pytest.mark.dry)
        if self.tier == "cpu":
            marks.append(pytest.mark.xdist_group(RECIPE_RUNS_GROUP))
        if self.tier == "gpu":
            marks += [pytest.mark.nightly, pytest.mark.gpu(self.gpus)]
        if self.is_rehearsal:
            marks.append(pytest.mark.rehearsal)
        return marks

    def to_json(self, nodeid: str = "") -> dict:
        """The record the CI suite runner reads (docs/testing.md, "Case metadata")."""
        return {
            "nodeid": nodeid,
            "name": self.name,
            "recipe": self.script,
            "tier": self.tier,
            "gpus": self.gpus,
            "timeout": self.timeout,
            "est_time": self.est_time,
            "suites": list(self.suites),
            "labels": list(self.labels),
            "nodes": self.gpu_nodes,
            "placement": self.placement,
        }


def parametrize_cases(cases: Iterable[RecipeCase], argname: str = "recipe_case"):
    """`@parametrize_cases(CASES)`: one test per case, id = case name, marks of its tier."""
    cases = list(cases)
    names = [c.name for c in cases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"case names must be unique; repeated: {dupes} (set variant=...)")
    params = [pytest.param(c, id=c.name, marks=c.marks()) for c in cases]
    return pytest.mark.parametrize(argname, params)


def discover_recipes(root: str | Path, pattern: str = "scripts/**/run_*.py") -> list[str]:
    """Recipe scripts under `root`, relative to it, sorted."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file())


RECIPE_PATTERN = "scripts/**/run_*.py"  # a recipe in a folder of its own under scripts/ is one too


def dry_cases(root: str | Path, pattern: str = RECIPE_PATTERN, **kw) -> list[RecipeCase]:
    """A dry case for every recipe matching `pattern` under `root`: adding a recipe file adds
    its dry check, with no test edit. A recipe in a sub-folder of scripts/ gets the folder in its
    id (`team.run_x-dry`), so it never collides with a top-level recipe of the same name."""
    root = Path(root).resolve()
    return [RecipeCase.dry(s, root=root, name=_dry_case_name(s), **kw) for s in discover_recipes(root, pattern)]


def _dry_case_name(script: str) -> str:
    folders = Path(script).parent.parts[1:]  # below scripts/
    return ".".join([*folders, Path(script).stem]) + "-dry"


def find_repo_root(start: str | Path) -> Path:
    """The nearest directory at or above `start` that holds a `scripts/` folder."""
    start = Path(start).resolve()
    if start.is_file():
        start = start.parent
    for base in (start, *start.parents):
        if (base / "scripts").is_dir():
            return base
    raise FileNotFoundError(f"no scripts/ directory at or above {start}")


def case_of(item: pytest.Item, argname: str = "recipe_case") -> RecipeCase | None:
    """The RecipeCase a collected test item was parametrized with, if any."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    value = callspec.params.get(argname)
    return value if isinstance(value, RecipeCase) else None


def cases_metadata(items: Sequence[pytest.Item]) -> list[dict]:
    out = []
    for item in items:
        case = case_of(item)
        if case is not None:
            out.append(case.to_json(item.nodeid))
    return out
