#!/usr/bin/env python3
"""Runs every bad input of ci/bad_inputs.py from the outside and judges each by the project's rule.

    python3 ci/bad_input_sweep.py [--fast] [--only TEXT] [--run RUN_DIR] [--json out.json]

Each row runs as a subprocess with a deadline, in a scratch folder of its own. It passes when it
exits non-zero, within its deadline, with no traceback on its output, its last line naming the
input, and nothing written into the repository. Prints a markdown table: input, exit, seconds,
verdict, last line. Exit 1 if a row fails. --run names a finished tiny run to copy for the rows
that need one (default: one trained here with the tiny recipe, 2 rollouts, once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ci.bad_inputs import ALL, BadInput  # noqa: E402

PROMPTS = "".join(json.dumps({"prompt": f"a {c} square", "metadata": {"color": c}}) + "\n"
                  for c in ("red", "blue", "green", "black"))


@dataclass
class Outcome:
    name: str
    exit: int | None
    seconds: float
    last_line: str
    problems: list[str]


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _copy_run(tmp: Path, run: Path) -> Path:
    shutil.copytree(run, tmp / "run")
    return tmp / "run"


def setup(kind: str | None, tmp: Path, run: Path | None) -> None:
    (tmp / "p.jsonl").write_text(PROMPTS)
    if kind == "bad_utf8":
        (tmp / "bad.jsonl").write_bytes(PROMPTS.encode() + b'{"prompt": "caf\xe9"}\n')
    elif kind == "bad_json":
        (tmp / "badjson.jsonl").write_text(PROMPTS + '{"prompt": "unterminated\n')
    elif kind == "custom_fns":
        (tmp / "userfns.py").write_text(USER_FUNCTIONS)
    elif kind == "custom_fns_broken":
        (tmp / "userfns_broken.py").write_text("def loss(args, inputs)\n    return 0.5, {}\n")
    elif kind == "readonly_data":
        pass  # --data-dir is replaced by a read-only place in argv (see READ_ONLY)
    elif kind == "failing_curl":  # a stand-in that fails as curl does with no network, never the network
        (tmp / "bin").mkdir()
        (tmp / "bin" / "curl").write_text("#!/bin/sh\necho 'curl: (6) Could not resolve host' >&2\nexit 6\n")
        (tmp / "bin" / "curl").chmod(0o755)
    elif kind == "file_out":
        (tmp / "out").write_text("a file, not a folder\n")
    elif kind in ("run", "run_truncated"):
        copied = _copy_run(tmp, run)
        if kind == "run_truncated":
            weights = _latest(copied) / "model_transformer.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
    elif kind in ("truncated_ckpt", "deleted_ckpt"):
        shutil.copytree(run / "checkpoints", tmp / "ckpts")
        weights = tmp / "ckpts" / (tmp / "ckpts" / "latest").read_text().strip() / "model_transformer.safetensors"
        weights.unlink() if kind == "deleted_ckpt" else weights.write_bytes(weights.read_bytes()[:100])


# a user's module (on the row's PYTHONPATH): each function breaks its contract in one way
USER_FUNCTIONS = """
def loss_float(args, inputs):
    return 0.5


def loss_raises(args, inputs):
    raise RuntimeError("my loss broke")


def loss_one_param(inputs):
    return 0.5, {}


async def rm_float(args, samples):
    return 0.5


async def rm_raises(args, samples):
    raise RuntimeError("my reward broke")
"""

READ_ONLY = "/proc/miles-data"  # read-only to every user, root included (a chmod would not stop root)


def expand(row: BadInput, tmp: Path, checkpoint: Path) -> list[str]:
    values = {"tmp": str(tmp), "repo": str(REPO), "ckpt": str(checkpoint), "run": str(tmp / "run")}
    argv = [a.format(**values) for a in row.argv]
    if row.setup == "readonly_data":
        argv[argv.index("--data-dir") + 1] = READ_ONLY
    return argv


def repo_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                          capture_output=True, text=True).stdout


def judge(row: BadInput, code: int | None, seconds: float, out: str, err: str, written: str) -> Outcome:
    lines = [line for line in (err.strip() or out.strip()).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    problems = []
    if code is None:
        problems.append(f"hung past {row.timeout:.0f} s")
    elif code == 0:
        problems.append("exit 0 (accepted)")
    if "Traceback (most recent call last)" in err + out:
        problems.append("traceback")
    if row.names.lower() not in last.lower():
        problems.append(f"last line does not name {row.names!r}")
    if written:
        problems.append(f"wrote into the repository: {written.split()[-1]}")
    return Outcome(row.name, code, seconds, last, problems)


def run_row(row: BadInput, checkpoint: Path, run: Path | None, scratch: Path) -> Outcome:
    tmp = Path(tempfile.mkdtemp(prefix="row-", dir=scratch))
    setup(row.setup, tmp, run)
    argv = expand(row, tmp, checkpoint)
    row_env = {k: v.format(tmp=tmp, path=os.environ.get("PATH", "")) for k, v in row.env.items()}
    env = {**os.environ, **row_env, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp}", "MILES_SCRIPT_MODEL_DIR": str(checkpoint.parent)}
    before = repo_state()
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=row.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the row's own process group, which it was started in
        out, err = proc.communicate()
        code = None
    seconds = time.monotonic() - start
    after = repo_state()
    written = "\n".join(sorted(set(after.splitlines()) - set(before.splitlines())))
    return judge(row, code, seconds, out, err, written)


def tiny_checkpoint(models: Path) -> Path:
    from miles.launcher.recipe_assets import ensure_recipe_checkpoint

    return Path(ensure_recipe_checkpoint("sd3", "tiny", str(models)))


def train_tiny_run(scratch: Path) -> Path:
    out = scratch / "tiny-run"
    subprocess.run([sys.executable, "scripts/run_diffusion_grpo_tiny_cpu.py", "--num-rollout", "2", "--output-dir",
                    str(out), "--run-id", "r", "--data-dir", str(scratch / "data"), "--extra-args",
                    "--save-interval 1"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out / "r"


def table(outcomes: list[Outcome]) -> str:
    rows = ["| input | exit | seconds | verdict | last line |", "|---|---|---|---|---|"]
    for o in outcomes:
        verdict = "ok" if not o.problems else "FAIL: " + "; ".join(o.problems)
        line = o.last_line.replace("|", "\\|")
        rows.append(f"| {o.name} | {o.exit if o.exit is not None else 'killed'} | {o.seconds:.1f} | {verdict} "
                    f"| {line} |")
    passed = sum(not o.problems for o in outcomes)
    return "\n".join(rows + ["", f"{passed}/{len(outcomes)} passed"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 ci/bad_input_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--fast", action="store_true", help="only the rows that stop before any cluster or model")
    p.add_argument("--only", default=None, help="only rows whose name contains TEXT")
    p.add_argument("--run", default=None, help="a finished tiny run dir for the export and --load rows")
    p.add_argument("--models", default=str(REPO / "models"), help="where the tiny checkpoint is (made once)")
    p.add_argument("--json", default=None, help="also write the outcomes as JSON here")
    ns = p.parse_args(argv)
    rows = [r for r in ALL if (r.fast or not ns.fast) and (ns.only is None or ns.only in r.name)]
    scratch = Path(tempfile.mkdtemp(prefix="miles-bad-input-sweep-"))
    try:
        checkpoint = tiny_checkpoint(Path(ns.models))
        needs_run = any(r.setup and ("run" in r.setup or "ckpt" in r.setup) for r in rows)
        run = Path(ns.run) if ns.run else (train_tiny_run(scratch) if needs_run else None)
        outcomes = [run_row(r, checkpoint, run, scratch) for r in rows]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(outcomes))
    if ns.json:
        Path(ns.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0 if all(not o.problems for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
