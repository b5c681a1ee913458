"""The replay catches what only a GPU would show: with the load order before issue 25 (the whole
pipeline in --param-dtype on the device, text encoders included, sharded only afterwards; kept as
a fixture in tests/unit/backends/test_sharded_load.py), Qwen-Image full is refused at setup, and
the refusal names the phase, the role and the largest tensors alive."""

from __future__ import annotations

import importlib
import sys

import pytest

from miles.replay.doc_table import repo_root
from miles.replay.report import replay_recipe

RECIPE = "scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py"


def _old_load_models():
    sys.path.insert(0, str(repo_root() / "tests" / "unit" / "backends"))
    try:
        return importlib.import_module("test_sharded_load")._old_load_models
    finally:
        sys.path.pop(0)


@pytest.mark.slow  # a ten-second Qwen-Image full replay guarding a load order long gone
def test_the_old_load_order_is_refused_for_qwen_image_full_at_setup(monkeypatch):
    from miles.backends.actor import TrainRank

    monkeypatch.setattr(TrainRank, "_load_models", _old_load_models())
    report = replay_recipe(repo_root() / RECIPE, "full", extrapolate=True)
    setup = [r for r in report.rows if r.phase == "setup" and r.place == "train GPU"]
    assert setup and not setup[0].fits, report.lines()
    problem = setup[0].problem
    assert problem.startswith("phase 'setup' on the train GPU") and "over its budget" in problem
    assert "train rank" in problem and "largest tensors alive: train rank:" in problem
    # the whole float32 transformer and the text encoder, on the device before sharding
    assert "float32" in problem and ("transformer." in problem or "text_encoder." in problem)
