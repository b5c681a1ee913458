"""Mutation check of the flag registry: each listed flag made a no-op in the source, its test must fail.

    python3 -m tests.tools.mutation_check [--flag --use-ema ...]

Each test run takes the shared heavy-run lock (/tmp/miles-heavy.lock, when `flock` exists), so the
check waits its turn test by test; or hold the lock for the whole check (the source is then never
left mutated while waiting for it):

    flock /tmp/miles-heavy.lock python3 -m tests.tools.mutation_check --no-lock

First each registered test runs on the untouched source (it must pass). Then for each mutation, one
at a time: rewrite the source so the trainer ignores the flag (a read of
the flag replaced by a constant), run the test tests/unit/flags/flag_effects.py registers for that
flag, put the source back byte for byte. A registered test that still passes under its mutation
does not observe its flag. Prints the table flag | mutation | registered test | outcome and exits
non-zero if any test passed or any anchor no longer matches.

The source is restored on every exit path: normal return, a failed test, an exception, Ctrl-C,
SIGTERM/SIGHUP (turned into an exception so the `finally` runs). Anchors are the flag reads
(`args.<dest>`), which survive rewrites of the code around them;
tests/unit/flags/test_flag_mutations.py fails in the default run when one stops matching.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
HEAVY_LOCK = "/tmp/miles-heavy.lock"


@dataclass(frozen=True)
class Mutation:
    flag: str
    path: str  # source file, relative to the repo root
    pattern: str  # regex of the flag's read(s); every match is replaced
    replacement: str
    what: str  # the mutation, in words


MUTATIONS = (
    Mutation("--diffusion-clip-range", "miles/backends/train_step.py", r"\bargs\.diffusion_clip_range\b", "0.2",
             "clip range hard-coded to 0.2"),
    Mutation("--diffusion-kl-beta", "miles/backends/train_step.py", r"\bargs\.diffusion_kl_beta\b", "0.0",
             "KL beta hard-coded to 0"),
    Mutation("--diffusion-kl-reference", "miles/backends/train_step.py", r"\b(?:self\.)?args\.diffusion_kl_reference\b",
             '"lora_base"', "KL reference always the LoRA base"),
    Mutation("--use-ema", "miles/backends/actor.py", r"\bargs\.use_ema\b", "False", "the EMA never built"),
    Mutation("--ema-decay", "miles/backends/actor.py", r"\bargs\.ema_decay\b", "0.995", "EMA decay hard-coded to 0.995"),
    Mutation("--lora-alpha", "miles/backends/lora.py", r"\bargs\.lora_alpha\b", "None",
             "--lora-alpha ignored (alpha = rank)"),
    Mutation("--eval-num-prompts", "miles/ray/rollout_manager.py", r"\bargs\.eval_num_prompts\b", "None",
             "--eval-num-prompts ignored (every eval prompt)"),
    Mutation("--weight-sync", "miles/ray/weight_sync_group.py", r"\bargs\.weight_sync\b", '"bucketed"',
             "--weight-sync ignored (always bucketed)"),
    Mutation("--lr-decay-style", "miles/backends/train_step.py", r"\bargs\.lr_decay_style\b", '"constant"',
             "LR decay style hard-coded to constant"),
    Mutation("--min-lr", "miles/backends/train_step.py", r"\bargs\.min_lr\b", "0.0", "--min-lr ignored (floor 0)"),
    Mutation("--num-epoch", "miles/backends/optimizer.py", r"\bargs\.num_epoch\b", "0",
             "LR schedule without a length under --num-epoch"),
    Mutation("--micro-batch-size", "miles/flags/batch_rules.py", r"\bns\.micro_batch_size\b(?!_)", "1",
             "micro-batch size hard-coded to 1"),
    Mutation("--diffusion-noise-level", "miles/rollout/types.py", r"\bargs\.diffusion_noise_level\b", "0.7",
             "noise level hard-coded to 0.7"),
    Mutation("--diffusion-guidance-scale", "miles/rollout/types.py", r"\bargs\.diffusion_guidance_scale\b(?!_)", "4.0",
             "guidance scale hard-coded to 4.0"),
)


def registry(root: Path = ROOT) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("flag_effects", root / "tests/unit/flags/flag_effects.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FLAG_TESTS


def mutate(source: str, mutation: Mutation) -> str:
    mutated, count = re.subn(mutation.pattern, mutation.replacement, source)
    if count == 0:
        raise LookupError(f"{mutation.flag}: anchor {mutation.pattern!r} no longer matches {mutation.path}")
    return mutated


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(f"signal {signum}")


@contextmanager
def mutated(root: Path, mutation: Mutation) -> Iterator[None]:
    """The source with `mutation` applied for the body; the original bytes back afterwards, whatever happens."""
    path = root / mutation.path
    original = path.read_bytes()
    new = mutate(original.decode(), mutation).encode()
    handlers = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        path.write_bytes(new)
        yield
    finally:
        path.write_bytes(original)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def run_test(root: Path, nodeid: str, lock: bool = True) -> bool:
    """True when the test passed. No bytecode is written, so no cached mutant outlives the run."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", nodeid, "-x", "-q", "-p", "no:cacheprovider"]
    if lock and shutil.which("flock"):
        cmd = ["flock", HEAVY_LOCK, *cmd]
    return subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def check(mutations, root: Path = ROOT, run=run_test, baseline: bool = True) -> list[tuple[Mutation, str, str]]:
    """(mutation, registered test, outcome) per mutation; outcome 'failed' is the wanted one. With
    `baseline`, each test first runs on the untouched source: a failure under a mutation only
    counts when the test passes without it."""
    tests = registry(root)
    passing = {nodeid: run(root, nodeid) for nodeid in dict.fromkeys(tests[m.flag] for m in mutations)} \
        if baseline else {}
    rows = []
    for m in mutations:
        nodeid = tests[m.flag]
        if baseline and not passing[nodeid]:
            rows.append((m, nodeid, "BASELINE FAILED: the test fails without the mutation"))
            continue
        try:
            with mutated(root, m):
                outcome = "PASSED (does not observe the flag)" if run(root, nodeid) else "failed"
        except LookupError as e:
            outcome = f"ANCHOR MISSING: {e}"
        rows.append((m, nodeid, outcome))
        print(f"{m.flag}: {outcome}", file=sys.stderr, flush=True)
    return rows


def table(rows) -> str:
    lines = ["| flag | mutation | registered test | failed under the mutation |", "|---|---|---|---|"]
    for m, nodeid, outcome in rows:
        lines.append(f"| `{m.flag}` | {m.what} (`{m.path}`) | `{nodeid}` | "
                     f"{'yes' if outcome == 'failed' else 'NO: ' + outcome} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flag", nargs="+", help="only these flags' mutations")
    parser.add_argument("--no-lock", action="store_true",
                        help="the caller holds the heavy-run lock already (flock ... python3 -m ...)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the runs on the untouched source")
    ns = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not ns.flag or m.flag in ns.flag]
    rows = check(chosen, run=lambda root, nodeid: run_test(root, nodeid, lock=not ns.no_lock),
                 baseline=not ns.no_baseline)
    print(table(rows))
    return 0 if all(outcome == "failed" for _, _, outcome in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
