"""Dry checks: run a recipe with submission off, read its plan, validate the argv in process.

The recipe runs as a subprocess with `MILES_SCRIPT_ENABLE_RAY_SUBMIT=0` and an output dir of
its own; the launcher then only writes `<output_dir>/<run_id>/plan.json`. The plan's argv is
handed to `train_diffusion.py`'s own validator (`miles.flags.arguments.validate_argv`) in this
process — no torch, no Ray — and the static invariants are asserted on the batch plan it
returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from miles.testing.cases import RecipeCase
from miles.testing.snapshot import Normalizer, render_plan

DRY_RUN_ENV = "MILES_SCRIPT_ENABLE_RAY_SUBMIT"

# Inherited variables that would change what a recipe assembles (script options, the GPUs of
# this shell, wandb, an outer cluster, the Hugging Face cache); dry runs drop them so a snapshot
# is the same anywhere.
_SCRUB_PREFIXES = ("MILES_", "SLURM_", "WANDB_", "HF_", "HUGGINGFACE_")
_SCRUB_NAMES = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "RAY_ADDRESS", "PYTHONBREAKPOINT", "XDG_CACHE_HOME",
                "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # each cluster names its own auth
# A fake key, so the wandb flags a recipe adds when a key is set are in every snapshot; it is a
# secret by name, redacted wherever the launcher shows or writes it.
FAKE_WANDB_API_KEY = "dry-run-fake-wandb-key-0123456789"
DRY_USER = "miles"


def frozen_env(repo: Path, out_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a dry run: what the plan depends on is fixed, so the snapshot of a recipe
    is the same on any machine and checkout. PYTHONPATH is the repo alone (its `miles`, whatever the
    caller's path), HOME a fresh folder under the output dir (an empty Hugging Face cache there, so
    a full-scale recipe shows its fetch commands), the user fixed, and WANDB_API_KEY a fake key."""
    env = scrubbed_env(base)
    home = out_dir / "home"
    env.update({
        DRY_RUN_ENV: "0", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "COLUMNS": "200",
        "PYTHONPATH": str(repo), "HOME": str(home), "USER": DRY_USER, "LOGNAME": DRY_USER,
        "WANDB_API_KEY": FAKE_WANDB_API_KEY,
    })
    return env


class DryCheckFailure(AssertionError):
    """A dry check failed; the message is written for the recipe's author. `dry` is the run when
    it got far enough to leave a plan (a launch refused by the memory plan writes its plan first)."""

    def __init__(self, message: str, dry: "DryRun | None" = None):
        super().__init__(message)
        self.dry = dry


def scrubbed_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name in list(env):
        if name.startswith(_SCRUB_PREFIXES) or name in _SCRUB_NAMES:
            del env[name]
    return env


def tail(text: str, n: int = 200) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:])


@dataclass
class DryRun:
    case: RecipeCase
    command: list[str]
    out_dir: Path
    returncode: int
    output: str
    wall_time: float
    plan_path: Path | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    repo_root: Path | None = None

    @property
    def argv(self) -> list[str]:
        return [str(a) for a in self.plan.get("argv", [])]

    def normalizer(self) -> Normalizer:
        repl: dict[str, str] = {}
        if self.plan.get("run_dir"):
            repl[str(self.plan["run_dir"])] = "<RUN_DIR>"
        repl[str(self.out_dir)] = "<OUTPUT_DIR>"
        ray_temp = (self.plan.get("ray") or {}).get("temp_dir")
        if ray_temp:
            repl[str(ray_temp)] = "<RAY_TEMP_DIR>"
        if self.plan.get("run_id"):
            repl[str(self.plan["run_id"])] = "<RUN_ID>"
        if self.repo_root is not None:
            repl[str(self.repo_root)] = "<REPO>"
        repl[sys.executable] = "<PYTHON>"
        home = os.path.expanduser("~")
        if home not in ("/", "") and (self.repo_root is None or str(self.repo_root) != home):
            repl[home] = "<HOME>"
        return Normalizer(repl, secrets=[*_secret_values(), FAKE_WANDB_API_KEY])

    @property
    def text(self) -> str:
        """The plan as snapshot text (normalised, one flag per line)."""
        return render_plan(self.plan, self.normalizer())

    def describe_failure(self, headline: str) -> str:
        return (
            f"{headline}\n"
            f"recipe: {self.case.script}\n"
            f"command: {' '.join(self.command)}\n"
            f"exit code: {self.returncode}\n"
            f"--- last 200 lines of its output ---\n{tail(self.output)}"
        )

    def check_static(self, validate: Callable[[Sequence[str]], Any] | None = None):
        """Validate the argv with the arguments module and assert the static invariants.
        Returns the batch plan."""
        return check_static(self, validate)


def _secret_values() -> list[str]:
    from miles.testing.snapshot import secret_values_from_env  # the launcher's one secret rule

    return secret_values_from_env()


@dataclass
class PendingDryRun:
    """A dry run started in the background (`start_dry`); `result()` waits for it."""

    case: RecipeCase
    command: list[str]
    out_dir: Path
    repo: Path
    proc: subprocess.Popen
    started: float
    timeout: float
    _done: DryRun | DryCheckFailure | None = None

    def result(self) -> DryRun:
        if self._done is None:
            self._done = _finish_dry(self)
        if isinstance(self._done, DryCheckFailure):
            raise self._done
        return self._done


def start_dry(
    case: RecipeCase,
    out_dir: str | Path,
    *,
    rootdir: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> PendingDryRun:
    """Start `case`'s recipe with submission off (output to a pipe); see `run_dry`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    script = case.script_path(rootdir)
    repo = case.repo_root(rootdir)
    if not script.is_file():
        raise DryCheckFailure(f"recipe {case.script} not found (looked under {repo})")
    command = [sys.executable, str(script), *case.args, "--output-dir", str(out_dir)]
    env = frozen_env(repo, out_dir)
    env.update(case.env)
    env.update(extra_env or {})
    proc = subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    return PendingDryRun(case, command, out_dir, repo, proc, time.monotonic(), timeout or case.timeout)


def _finish_dry(p: PendingDryRun) -> DryRun | DryCheckFailure:
    left = max(0.1, p.timeout - (time.monotonic() - p.started))
    try:
        output, _ = p.proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        p.proc.kill()  # a dry run starts nothing else; its own process is all there is to end
        output, _ = p.proc.communicate()
        dry = DryRun(p.case, p.command, p.out_dir, -9, output or "", time.monotonic() - p.started, repo_root=p.repo)
        return DryCheckFailure(dry.describe_failure(
            f"dry run of {p.case.script} did not finish within {p.timeout:.0f}s"))
    dry = DryRun(p.case, p.command, p.out_dir, p.proc.returncode, output, time.monotonic() - p.started,
                 repo_root=p.repo)
    plans = sorted(p.out_dir.glob("*/plan.json"))
    if dry.returncode != 0:
        if len(plans) == 1:
            dry.plan_path = plans[0]
            dry.plan = json.loads(plans[0].read_text())
        return DryCheckFailure(dry.describe_failure(f"dry run of {p.case.script} failed"),
                               dry if dry.plan else None)
    if len(plans) != 1:
        return DryCheckFailure(dry.describe_failure(
            f"dry run of {p.case.script} should leave exactly one <output_dir>/<run_id>/plan.json, "
            f"found {len(plans)}"))
    dry.plan_path = plans[0]
    dry.plan = json.loads(plans[0].read_text())
    return dry


def run_dry(
    case: RecipeCase,
    out_dir: str | Path,
    *,
    rootdir: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> DryRun:
    """Run `case`'s recipe with submission off and read back its plan.

    Raises DryCheckFailure when the recipe exits non-zero, times out or leaves no plan.
    """
    return start_dry(case, out_dir, rootdir=rootdir, extra_env=extra_env, timeout=timeout).result()


# -- static invariants ---------------------------------------------------------------------

def last_flag_values(argv: Sequence[str], flag: str) -> list[str] | None:
    """The values given to the last occurrence of `flag` (later wins), or None if absent."""
    found: list[str] | None = None
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if tok == flag:
            vals = []
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                vals.append(argv[j])
                j += 1
            found = vals
            i = j
            continue
        if tok.startswith(flag + "="):
            found = [tok.split("=", 1)[1]]
        i += 1
    return found


def _as_values(value: Any) -> list[str]:
    if value is None or value is True:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def _values_equal(actual: list[str], expected: list[str]) -> bool:
    if actual == expected:
        return True
    if len(actual) != len(expected):
        return False
    try:
        return all(float(a) == float(b) for a, b in zip(actual, expected))
    except ValueError:
        return False


def _default_validate(argv: Sequence[str]):
    """train_diffusion.py's own parse + validation: (namespace, batch plan); raises ConfigError."""
    from miles.flags.arguments import parse_and_plan

    return parse_and_plan(list(argv))


def check_static(dry: DryRun, validate: Callable[[Sequence[str]], Any] | None = None):
    """Validate the argv in process and assert the static invariants: batch identity, pair
    shards that divide, a GPU layout the launcher's cluster can hold, locked flags unchanged.

    `validate(argv)` returns a batch plan or a (namespace, batch plan) pair and raises on an
    invalid argv (default: `miles.flags.arguments.parse_and_plan`)."""
    validate = validate or _default_validate
    argv = dry.argv
    recipe = dry.case.script
    problems: list[str] = []
    try:
        result = validate(argv)
    except SystemExit as e:  # argparse: unknown flag or bad value (it printed the reason)
        raise DryCheckFailure(f"{recipe}: train_diffusion.py's parser rejects the assembled argv "
                              f"(exit {e.code}); argv:\n    " + "\n    ".join(" ".join(g) for g in _groups(argv))) from None
    except ValueError as e:  # ConfigError is a ValueError
        raise DryCheckFailure(
            f"{recipe}: train_diffusion.py rejects the assembled argv:\n    {e}\n"
            f"argv:\n    " + "\n    ".join(" ".join(g) for g in _groups(argv))
        ) from None
    ns, bp = result if isinstance(result, tuple) else (None, result)

    def get(name: str, default=None):
        return getattr(bp, name, default)

    samples = get("samples_per_rollout")
    if samples is not None:
        rbs, nsp = get("rollout_batch_size"), get("n_samples_per_prompt")
        gbs, nspr = get("global_batch_size"), get("num_steps_per_rollout")
        if rbs is not None and nsp is not None and rbs * nsp != samples:
            problems.append(f"batch identity: rollout_batch_size {rbs} x n_samples_per_prompt {nsp} != samples {samples}")
        if gbs is not None and nspr is not None and gbs * nspr != samples:
            problems.append(f"batch identity: global_batch_size {gbs} x num_steps_per_rollout {nspr} != samples {samples}")
        pairs, dp = get("train_pairs"), get("dp_size")
        if pairs is not None and dp:
            if pairs % dp:
                problems.append(f"train pairs {pairs} do not divide over dp_size {dp}")
            elif nspr and (pairs // dp) % nspr:
                problems.append(
                    f"num_pairs_shard={pairs // dp} not divisible by num_steps_per_rollout={nspr}")
        if gbs is not None and dp and gbs % dp:
            problems.append(f"global_batch_size {gbs} not divisible by dp_size {dp}")

    problems += _check_memory_plan(ns, bp)
    problems += _check_gpu_layout(dry.plan, ns)
    problems += _check_locked(dry.plan, argv)
    if problems:
        raise DryCheckFailure(f"{recipe}: static invariants violated:\n  - " + "\n  - ".join(problems))
    return bp


def _check_memory_plan(ns: Any, bp: Any) -> list[str]:
    """The per-GPU memory estimate of each role fits the GPU the argv declares (--gpu-memory-gb)."""
    if ns is None:
        return []
    from miles.plan.memory_plan import MemoryPlanError, build_memory_plan

    try:
        build_memory_plan(ns, bp).check()
    except MemoryPlanError as err:
        return [str(err)]
    return []


def _groups(argv):
    from miles.testing.snapshot import group_flags

    return group_flags(argv)


def _check_gpu_layout(plan: Mapping, ns: Any) -> list[str]:
    """The GPUs the argv's layout needs fit in the cluster the launcher builds (nodes x GPUs per
    node, and the visible-device list when one is given)."""
    if ns is None:
        return []
    nodes = int(plan.get("num_nodes") or 1)
    per_node = int(plan.get("num_gpus_per_node") or 0)
    if per_node == 0:  # a CPU job: the head starts with --num-gpus 0, train ranks use CPU slots
        if getattr(ns, "device", "cpu") != "cpu":
            return [f"the launcher starts a CPU job (num_gpus_per_node=0) but the argv trains on "
                    f"--device {ns.device}"]
        return []
    try:
        from miles.flags.validation import gpu_layout

        needed = gpu_layout(ns).needed
    except (ImportError, AttributeError):
        return []
    # Nodes beyond the launcher's own (a multi-node recipe's reward node joins as a worker) are
    # counted from the argv's --num-nodes, each with at most the launcher's GPUs per node.
    job_nodes = max(nodes, int(getattr(ns, "num_nodes", None) or 0))
    have = job_nodes * per_node
    problems = []
    if needed > have:
        problems.append(f"GPU layout needs {needed} GPUs, the job has {job_nodes} nodes x {per_node} = {have}")
    arg_per_node = getattr(ns, "num_gpus_per_node", None)
    if arg_per_node is not None and arg_per_node > per_node:
        problems.append(f"--num-gpus-per-node {arg_per_node} in the argv, but the launcher gives each node {per_node}")
    visible = plan.get("cuda_visible_devices")
    if visible and nodes == 1:
        n_visible = len([d for d in str(visible).split(",") if d.strip()])
        if n_visible < per_node:
            problems.append(f"cuda_visible_devices {visible!r} lists {n_visible} GPUs, the node needs {per_node}")
    return problems


def _check_locked(plan: Mapping, argv: Sequence[str]) -> list[str]:
    problems = []
    for flag, value in (plan.get("locked_flags") or {}).items():
        actual = last_flag_values(argv, flag)
        expected = _as_values(value)
        if actual is None:
            problems.append(f"locked flag {flag} is missing from the argv (locked to {' '.join(expected) or 'on'})")
        elif not _values_equal(actual, expected):
            problems.append(
                f"locked flag {flag} changed: locked to {' '.join(expected) or 'on'!r}, "
                f"argv ends with {' '.join(actual) or 'on'!r}")
    return problems
