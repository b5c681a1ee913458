#!/usr/bin/env python3
"""Dry-runs every `run_*.py` of a folder of launch scripts (miles-diffusion's, say) as they are,
dropped into `scripts/<folder name>/` of a scratch copy of this repository, and prints what became
of each: dry-run, or the one line it stopped with, and its flags by the vocabulary's rule (mapped,
no counterpart, refused). Fetches nothing: every run is a dry run (it prints its fetches), with an
empty Hugging Face cache of its own.

    python3 ci/sweep_launch_scripts.py /tmp/upstream-scripts [--json out.json] [--keep]

How each script is run, as its own docstring asks: `MILES_SCRIPT_ENABLE_RAY_SUBMIT=0`; a script that
asks for `MILES_SCRIPT_EXTERNAL_RAY=1` gets it, with an address nobody listens on; a data directory
already holding the prompt subsets a `prepare()` fetches (what a first, online run leaves behind),
`MILES_SCRIPT_DATA_JSONL` / `--data-jsonl` / `--prompt-data` naming a small JSONL file for scripts
that require one (SCRIPT_OPTIONS), and a placeholder for an API key a script forwards. A script that
does not use `U` and prints its train command in a dry run of its own (`--dry-run`) has that command
checked as the launcher would check it. The train argv of each launch is recorded by an observer of
`execute_train` (the launch itself runs unchanged) so the table can show its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Options a script requires before it reaches its launch ({items}: a small JSONL file, {out}: a folder)
SCRIPT_OPTIONS = {
    "run_diffusion_grpo_wan22_ti2v.py": ["--data-jsonl", "{items}"],
    "run_diffusion_sft_h3_ref2va.py": ["--prompt-data", "{items}"],
    "run_diffusion_sft_wan_controlnet.py": ["--data-jsonl", "{items}", "--output-dir", "{out}", "--dry-run"],
}
DATA_SUBSETS = ("flowgrpo_pickscore", "flowgrpo_ocr", "hpdv2")  # what the scripts' prepare() fetch
FORWARDED_KEYS = {"GEMINI_API_KEY": "sweep-placeholder"}
# Runs the script with `execute_train` observed: its train argv goes to $MILES_SWEEP_ARGV_FILE
OBSERVER = """
import json, os, runpy, sys
from miles.launcher import train_launch
launch = train_launch.execute_train
def observed(train_args, num_gpus_per_node, config, **options):
    with open(os.environ["MILES_SWEEP_ARGV_FILE"], "w") as out:
        json.dump({"train_args": train_args, "extra_args": config.extra_args,
                   "train_script": options.get("train_script", "train_diffusion.py")}, out)
    return launch(train_args, num_gpus_per_node, config, **options)
train_launch.execute_train = observed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class Row:
    script: str
    outcome: str  # "dry-run", "stopped: <its one line>", "traceback: <last line>"
    mapped: list[str] = field(default_factory=list)
    no_counterpart: list[str] = field(default_factory=list)
    refused: str = ""


def scratch_copy(scripts: Path, root: Path) -> Path:
    """This repository's tracked and unignored files, with the scripts under scripts/<folder>/."""
    repo = root / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for name in listed:
        source = REPO / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    target = repo / "scripts" / scripts.name
    target.mkdir(parents=True, exist_ok=True)
    for script in sorted(scripts.glob("run_*.py")):
        shutil.copy2(script, target / script.name)
    return repo


def fixtures(root: Path) -> dict[str, str]:
    """A data dir holding the prompt subsets, a small JSONL file of items, an empty HF cache."""
    data = root / "datasets"
    for subset in DATA_SUBSETS:
        folder = data / "miles-diffusion-datasets" / subset
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            lines = "".join(json.dumps({"input": f"prompt {i} of {subset} {split}"}) + "\n" for i in range(64))
            (folder / f"{split}.jsonl").write_text(lines)
    items = root / "items.jsonl"
    items.write_text("".join(json.dumps({"prompt": f"item {i}", "metadata": {}}) + "\n" for i in range(64)))
    return {"data": str(data), "items": str(items), "hf": str(root / "hf")}


def run_script(repo: Path, script: Path, paths: dict[str, str], root: Path) -> Row:
    out = root / "out" / script.stem
    argv_file = root / "argv" / f"{script.stem}.json"
    argv_file.parent.mkdir(parents=True, exist_ok=True)
    options = [o.format(items=paths["items"], out=out) for o in SCRIPT_OPTIONS.get(script.name, [])]
    text = script.read_text()
    uses_u = "command_utils as U" in text
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "HF_", "WANDB_", "RAY_"))}
    env.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "HF_HOME": paths["hf"],
                "MILES_SCRIPT_DATA_DIR": paths["data"], "MILES_SCRIPT_DATA_JSONL": paths["items"],
                "MILES_SWEEP_ARGV_FILE": str(argv_file), "PYTHONPATH": str(repo), "COLUMNS": "200",
                **FORWARDED_KEYS})
    if "MILES_SCRIPT_EXTERNAL_RAY" in text:  # it asks to be submitted into an existing cluster
        env.update({"MILES_SCRIPT_EXTERNAL_RAY": "1", "MILES_SCRIPT_RAY_ADDRESS": "http://127.0.0.1:9"})
    if uses_u:
        options += ["--output-dir", str(out), "--run-id", "sweep"]
        command = [sys.executable, "-c", OBSERVER, str(script), *options]
    else:
        command = [sys.executable, str(script), *options]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    row = _outcome(script.name, done, out / "sweep" / "plan.json")
    if not uses_u and done.returncode == 0:
        return _check_printed_command(script.name, done.stdout, repo)
    if argv_file.is_file():
        _classify(row, json.loads(argv_file.read_text()))
    return row


def _outcome(name: str, done: subprocess.CompletedProcess, plan: Path) -> Row:
    err = [line for line in done.stderr.splitlines() if line.strip()]
    if "Traceback" in done.stderr or "─ Traceback" in done.stderr:
        return Row(name, f"traceback: {err[-1] if err else ''}")
    if done.returncode == 0 and plan.is_file():
        return Row(name, "dry-run")
    if done.returncode == 0:
        return Row(name, "exited 0 without a plan")
    return Row(name, f"stopped: {err[-1] if err else f'exit {done.returncode}'}")


def _classify(row: Row, launch: dict) -> None:
    from miles.launcher.flags import split_args
    from miles.flags.flag_vocabulary import FlagRefused, translate

    argv = [*split_args(launch["train_args"]), *split_args(launch["extra_args"])]
    try:
        result = translate(argv)
        row.mapped = [line.split(" -> ")[0].split()[0] for line in result.mapped]
        row.no_counterpart = [line.split(":")[0].split()[0] for line in result.no_counterpart]
    except FlagRefused as err:
        row.refused = str(err).split(":")[0]
        return
    if row.outcome.startswith("stopped"):
        row.refused = refused_name(row.outcome)


def refused_name(line: str) -> str:
    """What a one-line refusal names first: a flag, or the train script."""
    text = line.rsplit("error: ", 1)[-1]
    if text.startswith("train_script="):
        return text.split(":", 1)[0]
    found = re.search(r"--[a-z0-9][a-z0-9-]*", text)
    return found.group(0) if found else text[:120]


def _check_printed_command(name: str, stdout: str, repo: Path) -> Row:
    """A script's own dry run printed `python train_X.py ARGS`: checked as the launcher checks it."""
    from miles.launcher.launch_checks import TrainScriptError, parse_train_argv, resolve_train_script
    from miles.flags.flag_vocabulary import FlagRefused, translate

    words = shlex.split(stdout.strip().splitlines()[-1])
    script, argv = words[1], words[2:]
    row = Row(name, "own dry run: printed its train command")
    try:
        resolve_train_script(script)
        result = translate(argv)
        row.mapped = [line.split(" -> ")[0].split()[0] for line in result.mapped]
        row.no_counterpart = [line.split(":")[0].split()[0] for line in result.no_counterpart]
        parse_train_argv(result.argv)
        row.outcome += "; the launcher would run it"
    except (TrainScriptError, FlagRefused, ValueError, RuntimeError) as err:  # TrainArgvError: the parser's line
        line = str(err).splitlines()[0]
        row.outcome += f"; the launcher would stop: {line}"
        row.refused = refused_name(line)
    return row


def table(rows: list[Row]) -> str:
    lines = ["| script | outcome | mapped | no counterpart | refused |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r.script, r.outcome.replace("|", "\\|"), ", ".join(sorted(set(r.mapped))),
                 ", ".join(sorted(set(r.no_counterpart))), r.refused.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", type=Path, help="a folder of run_*.py launch scripts")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="miles-sweep-"))
    try:
        repo = scratch_copy(args.scripts.resolve(), root)
        paths = fixtures(root)
        rows = [run_script(repo, s, paths, root) for s in sorted((repo / "scripts" / args.scripts.name).glob("run_*.py"))]
    finally:
        if args.keep:
            print(f"scratch copy: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    tracebacks = [r.script for r in rows if r.outcome.startswith("traceback")]
    print(f"\n{len(rows)} scripts: {sum(r.outcome == 'dry-run' for r in rows)} dry-run, "
          f"{sum(r.outcome.startswith('stopped') for r in rows)} stopped in one line, {len(tracebacks)} traceback(s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 1 if tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
