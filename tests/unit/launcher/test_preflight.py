"""Issue 27: every bad input is refused by the launcher's preflight, before Ray: one line naming the
flag and the fix, exit status 2, and nothing written but the refused launch's own record.

Each case runs the tiny CPU recipe for real (MILES_SCRIPT_ENABLE_RAY_SUBMIT=1) on the shared tiny
checkpoint; a case the preflight let through would start a Ray head, which the assertions catch
(no .launcher record, no job log)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "scripts" / "run_diffusion_grpo_tiny_cpu.py"
RUN_ID = "r"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint("sd3")).parent


def launch(tmp_path: Path, model_dir: Path, *options: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    environ.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "1", **(env or {})})
    argv = [sys.executable, str(RECIPE), "--model-dir", str(model_dir), "--data-dir", str(tmp_path / "data"),
            "--output-dir", str(tmp_path / "out"), "--run-id", RUN_ID, "--num-rollout", "2", *options]
    return subprocess.run(argv, capture_output=True, text=True, env=environ, timeout=120, cwd=tmp_path)


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_refused(result: subprocess.CompletedProcess, out: Path, *words: str, before: dict | None = None) -> str:
    """Exit 2, one error line naming `words`; under the output dir, what was there (`before`) is
    byte-identical and only the refusal record was added."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for word in (*words, "fix"):
        assert word in errors[0], errors[0]
    before = before or {}
    after = files_under(out) if out.exists() else {}
    assert {k: after.get(k) for k in before} == before
    added = [Path(p) for p in set(after) - set(before)]
    assert all(p.parent == Path(RUN_ID) and p.name.startswith("refused-") for p in added), added
    return errors[0]


def prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def checkpoint_without(model_dir: Path, tmp_path: Path, part: str) -> Path:
    copy = tmp_path / "sd3-copy"
    shutil.copytree(model_dir / "miles-sd3-tiny-seed0", copy)
    shutil.rmtree(copy / part)
    return copy


BAD_INPUTS = {
    # id: (options, words the one line must hold); {tmp} is the test's tmp_path
    "num-nodes-0": (["--num-nodes", "0"], ("--num-nodes 0",)),
    "gpus-with-cpu": (["--cuda-visible-devices", "0,1"], ("--cuda-visible-devices 0,1", "--device cpu")),
    "one-prompt": (["--extra-args", "--prompt-data {tmp}/one.jsonl"],
                   ("--prompt-data", "1 distinct prompt", "--rollout-batch-size")),
    "malformed-prompts": (["--extra-args", "--prompt-data {tmp}/bad.jsonl"], ("--prompt-data", "bad.jsonl:2")),
    "missing-prompts": (["--extra-args", "--prompt-data {tmp}/none.jsonl"], ("--prompt-data", "none.jsonl")),
    "missing-checkpoint": (["--extra-args", "--hf-checkpoint {tmp}/no-sd3-here"], ("--hf-checkpoint",)),
    "checkpoint-without-vae": (["--extra-args", "--hf-checkpoint {tmp}/sd3-copy"], ("--hf-checkpoint", "vae/")),
    "foreign-transformer": (["--extra-args", "--hf-checkpoint {tmp}/sd3-copy"],
                            ("--hf-checkpoint", "LTX2VideoTransformer3DModel", "SD3Transformer2DModel")),
    "height-63": (["--extra-args", "--diffusion-height 63"], ("--diffusion-height 63", "48 or 64")),
    "reward-signature": (["--extra-args", "--rm-type custom --custom-rm-path myrm:one_arg"],
                         ("--custom-rm-path myrm:one_arg", "1 positional")),
    "reward-unimportable": (["--extra-args", "--rm-type custom --custom-rm-path nosuch_mod:rm"],
                            ("--custom-rm-path", "'nosuch_mod' not found")),
    "load-missing": (["--extra-args", "--load {tmp}/nowhere"], ("--load", "nowhere/latest")),
    "load-empty-dir": (["--extra-args", "--load {tmp}"], ("--load", "latest is missing")),
    "unclosed-quote": (["--extra-args", '--lr "5e-4'], ("--extra-args", "value of --lr")),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_line_exit_2_and_writes_only_its_refusal(tmp_path, model_dir, case):
    options, words = BAD_INPUTS[case]
    prompt_file(tmp_path / "one.jsonl", ["a red cube"])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{not json\n')
    (tmp_path / "myrm.py").write_text("async def one_arg(args):\n    return []\n")
    if case == "checkpoint-without-vae":
        checkpoint_without(model_dir, tmp_path, "vae")
    if case == "foreign-transformer":  # another architecture's transformer under an sd3 pipeline
        copy = checkpoint_without(model_dir, tmp_path, "scheduler")
        shutil.copytree(model_dir / "miles-sd3-tiny-seed0" / "scheduler", copy / "scheduler")
        index = json.loads((copy / "model_index.json").read_text())
        index["transformer"] = ["diffusers", "LTX2VideoTransformer3DModel"]
        (copy / "model_index.json").write_text(json.dumps(index))
    options = [o.replace("{tmp}", str(tmp_path)) for o in options]
    result = launch(tmp_path, model_dir, *options, env={"PYTHONPATH": str(tmp_path)})
    assert_refused(result, tmp_path / "out", *words)


def _safetensors_of_random_floats(count: int) -> bytes:
    """A whole safetensors file (the preflight reads its header) of one float32 tensor of random values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(4 * count)


def _earlier_run(out: Path, run_id: str, flags: dict | None = None) -> Path:
    """A finished run's dir as a real run leaves it: plan.json, run.json and two checkpoints whose
    records name the run, its training flags and its data order."""
    from miles.records import checkpoint_identity as identity

    run_dir = out / run_id
    save = run_dir / "checkpoints"
    for rollout_id in (0, 1):
        ckpt = save / f"rollout_{rollout_id:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model_transformer.safetensors").write_bytes(_safetensors_of_random_floats(16))
        record = {"rollout_id": rollout_id, "run_id": run_id, "training_flags": flags or {},
                  "data_order": {"seed": 1234, "shuffle": True, "epoch": 0, "offset": 4 * (rollout_id + 1),
                                 "num_prompts": 64}, "code_version": identity.code_version()}
        (ckpt / identity.RECORD).write_text(json.dumps(record))
    (save / "latest").write_text("rollout_000001\n")
    (run_dir / "plan.json").write_text('{"earlier": "plan"}\n')
    (run_dir / "run.json").write_text('{"earlier": "run", "attempts": [{"attempt": 1, "exit": 0}]}\n')
    return save


def test_a_refused_launch_leaves_an_earlier_runs_plan_run_json_and_checkpoints_byte_identical(tmp_path, model_dir):
    out = tmp_path / "out"
    _earlier_run(out, RUN_ID)
    before = files_under(out)
    result = launch(tmp_path, model_dir)  # the same --run-id, without --load
    line = assert_refused(result, out, "already holds committed checkpoints", "--load", before=before)
    after = files_under(out)
    added = set(after) - set(before)
    assert len(added) == 1 and Path(next(iter(added))).name.startswith("refused-")
    assert json.loads(after[next(iter(added))])["reason"] == line.removeprefix("error: ")


def test_a_save_dir_of_another_run_is_refused_even_with_load(tmp_path, model_dir):
    out = tmp_path / "out"
    theirs = _earlier_run(out, "theirs")
    before = files_under(out)
    result = launch(tmp_path, model_dir, "--extra-args", f"--save {theirs} --load {theirs}")
    assert_refused(result, out, f"--save {theirs}", "another run (theirs", before=before)


def test_a_load_trained_with_other_flags_names_each_difference_and_a_seed_conflict_is_refused(tmp_path, model_dir):
    from miles.records import checkpoint_identity as identity
    from miles.flags.arguments import parse_and_plan

    out = tmp_path / "out"
    # the flags a real launch of this recipe trains with, but another learning rate and trainer seed
    argv = _recipe_argv(tmp_path, model_dir)
    flags = identity.training_flags(parse_and_plan(argv)[0])
    flags.update(lr=5e-4, seed=7)
    theirs = _earlier_run(out, "theirs", flags)
    before = files_under(out)
    result = launch(tmp_path, model_dir, "--extra-args", f"--load {theirs}")
    line = assert_refused(result, out, "--lr 0.002 (checkpoint: 0.0005)", "--seed 1234 (checkpoint: 7)",
                          "--load-anyway", before=before)
    assert line.count("(checkpoint:") == 2
    seed = launch(tmp_path, model_dir, "--extra-args", f"--load {theirs} --load-anyway --rollout-seed 99")
    assert_refused(seed, out, "--rollout-seed 99 (checkpoint: 1234)", before=before)


def _recipe_argv(tmp_path: Path, model_dir: Path) -> list[str]:
    """The train argv the recipe assembles (its dry run's plan.json)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    environ["MILES_SCRIPT_ENABLE_RAY_SUBMIT"] = "0"
    dry = tmp_path / "dry"
    subprocess.run([sys.executable, str(RECIPE), "--model-dir", str(model_dir), "--data-dir", str(tmp_path / "data"),
                    "--output-dir", str(dry), "--run-id", "d", "--num-rollout", "2"], check=True, env=environ,
                   capture_output=True, cwd=tmp_path)
    return json.loads((dry / "d" / "plan.json").read_text())["argv"]
