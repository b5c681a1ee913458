"""Dry checks of every recipe under scripts/: found by glob, so a new recipe needs no edit here.

Each runs the recipe with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0, validates the argv it assembles
with train_diffusion.py's own parser (in process, no torch) and compares the plan with its
snapshot under __snapshots__/test_dry/ (the batch arguments and the per-GPU memory plan).
Re-record after an intended recipe edit with `pytest tests/e2e -m dry --snapshot-update`.
"""

from pathlib import Path

from miles.testing import dry_cases, parametrize_cases

REPO_ROOT = Path(__file__).resolve().parents[2]

@parametrize_cases(dry_cases(REPO_ROOT))
def test_dry(recipe_case, dry_run, check_static, plan_snapshot):
    dry = dry_run(recipe_case)
    check_static(dry)
    assert plan_snapshot == dry.text

