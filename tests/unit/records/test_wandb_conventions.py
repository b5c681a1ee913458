"""Issue 11, point 10: wandb follows its own environment conventions and never costs the run."""

import argparse

import pytest

wandb = pytest.importorskip("wandb")

from miles.records.run_logging import init_wandb  # noqa: E402


def _args(tmp_path, **kw):
    base = dict(use_wandb=True, wandb_project=None, wandb_group=None, wandb_run_name=None, wandb_mode=None,
                wandb_dir=None, wandb_required=False, run_dir=str(tmp_path))
    return argparse.Namespace(**{**base, **kw})


def test_environment_is_honoured_unless_a_flag_is_given(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or "run")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "envproj")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wd"))
    assert init_wandb(_args(tmp_path)) == "run"
    assert (seen["mode"], seen["project"], seen["entity"], seen["dir"]) == ("offline", "envproj", "team",
                                                                            str(tmp_path / "wd"))
    init_wandb(_args(tmp_path, wandb_mode="online", wandb_project="flag"))
    assert (seen["mode"], seen["project"]) == ("online", "flag")


def test_a_wandb_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def refuse(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty)\nlong detail")

    monkeypatch.setattr(wandb, "init", refuse)
    assert init_wandb(_args(tmp_path)) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING: wandb could not start") and "metrics.jsonl" in err[0]
    with pytest.raises(RuntimeError, match="--wandb-required"):
        init_wandb(_args(tmp_path, wandb_required=True))


def test_parser_leaves_wandb_mode_to_the_environment():
    from miles.flags.arguments import build_parser

    ns = build_parser().parse_args(["--hf-checkpoint", "x"])
    assert ns.wandb_mode is None and ns.wandb_required is False


def test_a_resumed_run_continues_the_wandb_run_its_checkpoint_recorded(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or "run")
    init_wandb(_args(tmp_path))
    assert "id" not in seen and "resume" not in seen  # a fresh run: wandb picks a new id
    init_wandb(_args(tmp_path), resume_id="abc123")
    assert (seen["id"], seen["resume"]) == ("abc123", "allow")
