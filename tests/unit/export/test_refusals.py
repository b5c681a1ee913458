"""What `python3 -m miles.export` refuses, each with one line naming what is missing, and never
a half-written --out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from export_runs import export, make_run


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_checkpoint):
    run_dir, _ = make_run(tmp_path_factory.mktemp("refusals") / "run", tiny_checkpoint("sd3"), "sd3", lora=False)
    return run_dir


@pytest.fixture
def copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    argv = json.loads((target / "run.json").read_text())["argv"]
    argv[argv.index("--save") + 1] = str(target / "checkpoints")
    (target / "run.json").write_text(json.dumps({"argv": argv}))
    return target


def refusal(capsys, *argv) -> str:
    assert export(*argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_an_existing_out_is_refused_unless_overwrite_and_an_earlier_export(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert "--overwrite" in refusal(capsys, run, "--out", out)
    assert "not an earlier export" in refusal(capsys, run, "--out", out, "--overwrite")
    assert (out / "mine.txt").read_text() == "keep"
    shutil.rmtree(out)
    assert export(run, "--out", out) == 0
    (out / "mine.txt").write_text("an earlier export's folder: --overwrite may replace it")
    assert export(run, "--out", out, "--overwrite") == 0
    assert not (out / "mine.txt").exists() and (out / "transformer" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it


def test_another_family_than_asked_is_refused(run, tmp_path, capsys):
    line = refusal(capsys, run, "--out", tmp_path / "out", "--family", "wan2_2")
    assert "sd3 checkpoint" in line and "--family sd3" in line
    assert not (tmp_path / "out").exists()


def test_an_incomplete_checkpoint_names_the_missing_file(copy, tmp_path, capsys):
    (copy / "checkpoints" / "rollout_000002" / "rank0.json").unlink()
    assert "rank0.json missing" in refusal(capsys, copy, "--out", tmp_path / "out")
    (copy / "checkpoints" / "rollout_000002" / "trainer.json").unlink()
    assert "trainer.json, rank0.json missing" in refusal(capsys, copy / "checkpoints" / "rollout_000002",
                                                         "--out", tmp_path / "out")


def test_a_checkpoint_mid_commit_is_refused(copy, tmp_path, capsys):
    staging = copy / "checkpoints" / ".staging_rollout_000005"
    staging.mkdir()
    assert "mid-commit" in refusal(capsys, copy, "--out", tmp_path / "out", "--rollout", "5")
    assert "mid-commit" in refusal(capsys, staging, "--out", tmp_path / "out")
    (copy / "checkpoints" / "latest").unlink()
    line = refusal(capsys, copy, "--out", tmp_path / "out")
    assert "latest is missing" in line and ".staging_rollout_000005" in line


def test_a_corrupt_checkpoint_leaves_no_out(copy, tmp_path, capsys):
    weights = copy / "checkpoints" / "rollout_000002" / "model_transformer.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "was not written" in refusal(capsys, copy, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_flags_the_checkpoint_cannot_honour_are_refused(run, tmp_path, capsys):
    assert "no EMA weights" in refusal(capsys, run, "--out", tmp_path / "out", "--ema")
    assert "--rollout abc" in refusal(capsys, run, "--out", tmp_path / "out", "--rollout", "abc")
    assert "rollout_000001 does not exist" in refusal(capsys, run, "--out", tmp_path / "out", "--rollout", "1")
    assert "no run.json" in refusal(capsys, Path(shutil.copytree(run / "checkpoints", tmp_path / "alone")),
                                    "--out", tmp_path / "out")


def test_a_lora_checkpoint_refuses_pipeline(tmp_path, tiny_checkpoint, capsys):
    run_dir, _ = make_run(tmp_path / "lora", tiny_checkpoint("sd3"), "sd3", lora=True)
    assert "drop --pipeline" in refusal(capsys, run_dir, "--out", tmp_path / "out", "--pipeline")


def test_the_model_card_names_recipe_base_rollout_flags_and_metrics(run, tmp_path):
    assert export(run, "--out", tmp_path / "out") == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "rollout 2" in card and "revision: local, configs sha256:" in card
    assert "- `--lr` = `0.001`" in card and "`rollout/reward/raw_mean`: 0.5" in card
    assert "perf/" not in card and "- `--save`" not in card
    assert "train_diffusion.py" in card  # no plan.json here: the card says it ran without a recipe


def test_max_shard_size_cuts_the_transformer_into_the_shards_its_index_names(run, tmp_path):
    assert export(run, "--out", tmp_path / "out", "--max-shard-size", "200KB") == 0
    folder = tmp_path / "out" / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((folder / s).is_file() for s in shards)
