"""An export never writes where it reads: not into, around or over the run, its checkpoints or the
base checkpoint, and `--overwrite` replaces only an earlier export. Each refusal leaves every byte
it was pointed at as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from export_runs import export, make_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_checkpoint):
    run_dir, _ = make_run(tmp_path_factory.mktemp("destination") / "run", tiny_checkpoint("sd3"), "sd3", lora=False)
    return run_dir


@pytest.fixture
def run(pristine, tmp_path):
    """A run dir of this test's own, its run.json's --save naming it (as the trainer wrote it)."""
    target = tmp_path / "runs" / "run"
    shutil.copytree(pristine, target)
    _record_save(target, target / "checkpoints")
    return target


def _record_save(run_dir: Path, save: Path) -> None:
    record = json.loads((run_dir / "run.json").read_text())
    argv = record["argv"]
    argv[argv.index("--save") + 1] = str(save)
    (run_dir / "run.json").write_text(json.dumps(record))


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def refused(capsys, *argv) -> str:
    assert export(*argv) == 1
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("where", ["run", "checkpoints", "checkpoint", "inside-run", "around-run"])
def test_an_out_that_overlaps_the_run_is_refused_and_leaves_it_byte_identical(run, capsys, where):
    out = {"run": run, "checkpoints": run / "checkpoints", "checkpoint": run / "checkpoints" / "rollout_000002",
           "inside-run": run / "exported", "around-run": run.parent}[where]
    before = tree_digest(run.parent)
    line = refused(capsys, run, "--out", out, "--overwrite")
    assert "pick an --out outside it" in line
    assert tree_digest(run.parent) == before


def test_an_out_inside_another_runs_directory_is_refused(run, pristine, tmp_path, capsys):
    other = tmp_path / "other-run"
    shutil.copytree(pristine, other)
    line = refused(capsys, run, "--out", other / "checkpoints" / "export")
    assert "lies inside a checkpoints directory" in line
    assert not (other / "checkpoints" / "export").exists()


def test_an_out_at_or_inside_the_base_checkpoint_is_refused(pristine, tmp_path, tiny_checkpoint, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint("sd3"), base)
    run_dir, _ = make_run(tmp_path / "run", base, "sd3", lora=False)
    before = tree_digest(base)
    assert "the base checkpoint" in refused(capsys, run_dir, "--out", base, "--overwrite", "--pipeline")
    assert "the base checkpoint" in refused(capsys, run_dir, "--out", base / "transformer", "--overwrite")
    assert tree_digest(base) == before


def test_overwrite_replaces_an_earlier_export_but_never_one_that_now_holds_a_run(run, tmp_path, capsys):
    out = tmp_path / "export"
    assert export(run, "--out", out) == 0
    assert export(run, "--out", out, "--overwrite") == 0
    shutil.copytree(run, out / "moved-in-run")
    line = refused(capsys, run, "--out", out, "--overwrite")
    assert "holds a run directory" in line and (out / "moved-in-run" / "run.json").is_file()


def test_a_copied_run_exports_its_own_checkpoints_not_the_recorded_ones(pristine, tmp_path, capsys):
    """run.json still names the original's --save: the copy's truncated weights fail the export,
    where reading the record would have exported the original's weights without a word."""
    copy = tmp_path / "copy"
    shutil.copytree(pristine, copy)
    weights = copy / "checkpoints" / "rollout_000002" / "model_transformer.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    line = refused(capsys, copy, "--out", tmp_path / "out")
    assert str(copy / "checkpoints" / "rollout_000002") in line and "was not written" in line


def test_a_moved_run_exports_from_where_it_is_now_and_its_card_says_so(pristine, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(pristine, moved)
    _record_save(moved, tmp_path / "gone" / "checkpoints")
    assert export(moved, "--out", tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "records --save" in err and str(moved / "checkpoints") in err
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"checkpoint: `{moved / 'checkpoints' / 'rollout_000002'}`" in card


def test_a_run_without_its_checkpoints_names_the_recorded_save_and_the_fix(pristine, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(pristine, bare, ignore=shutil.ignore_patterns("checkpoints"))
    line = refused(capsys, bare, "--out", tmp_path / "out")
    assert "has no checkpoints/" in line and str(pristine / "checkpoints") in line and f"to {bare / 'checkpoints'}" in line


def test_exported_files_get_the_umask_permissions_and_the_base_keeps_its_own(run, tmp_path):
    old = os.umask(0o022)
    try:
        assert export(run, "--out", tmp_path / "out", "--pipeline") == 0
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path / "out")): stat.S_IMODE(p.stat().st_mode)
             for p in (tmp_path / "out").rglob("*") if p.is_file() and p.stat().st_nlink == 1}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes
