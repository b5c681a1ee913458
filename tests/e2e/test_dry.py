"""Dry checks of every recipe under scripts/: found by glob, so a new recipe needs no edit here.

Each runs the recipe with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0, validates the argv it assembles
with train_diffusion.py's own parser (in process, no torch) and compares the plan with its
snapshot under __snapshots__/test_dry/ (the batch arguments and the per-GPU memory plan).
Re-record after an intended recipe edit with `pytest tests/e2e -m dry --snapshot-update`.
"""

from pathlib import Path

from miles.testing import dry_cases, parametrize_cases

REPO_ROOT = Path(__file__).resolve().parents[2]

# Full-scale recipes whose memory plan does not fit their declared GPUs with the trainer as built
# (the data-parallel backend: every train rank holds a float32 master and a compute copy of every
# transformer, unsharded). They need sharded training and offload (issue 16, points 1-2, not done).
# Their dry check must fail for memory, naming the GPU whose estimate is over budget; the plan is
# still snapshotted. A recipe that starts to fit fails this test: take its entry out.
OVER_BUDGET = {
    "run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned": "train GPU",
    "run_diffusion_grpo_wan22_pickscore_5gpu": "train GPU",
    "run_diffusion_grpo_wan22_pickscore_17gpu_multinode": "train GPU",
    "run_diffusion_sft_wan22": "train GPU",
}


@parametrize_cases(dry_cases(REPO_ROOT))
def test_dry(recipe_case, dry_run, check_static, plan_snapshot):
    over = OVER_BUDGET.get(Path(recipe_case.script).stem)
    if over is None:
        dry = dry_run(recipe_case)
        check_static(dry)
    else:
        failure = dry_run(recipe_case, expect_failure=True)
        message = str(failure)
        assert f"memory plan: each {over} needs an estimated" in message, message
        assert "GiB" in message and "budget" in message and "what would help" in message, message
        dry = failure.dry
        assert dry is not None, message
    assert plan_snapshot == dry.text
