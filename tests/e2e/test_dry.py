"""Dry checks of every recipe under scripts/: found by glob, so a new recipe needs no edit here.

Each runs the recipe with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0, validates the argv it assembles
with train_diffusion.py's own parser (in process, no torch) and compares the plan with its
snapshot under __snapshots__/test_dry/ (the batch arguments and the per-GPU memory plan).
Re-record after an intended recipe edit with `pytest tests/e2e -m dry --snapshot-update`.
"""

from pathlib import Path

from miles.testing import RecipeCase, dry_cases, parametrize_cases

REPO_ROOT = Path(__file__).resolve().parents[2]

# The full-parameter Wan2.2 A14B recipe with its sharding and offload taken away: every train
# rank would hold a whole float32 master, a bf16 copy and AdamW state of both experts beside its
# engine. Its dry check must fail for memory, naming the GPU, the estimate, the budget and the fix.
UNSHARDED = RecipeCase.dry(
    "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py", root=REPO_ROOT, variant="unsharded",
    args=("--extra-args", "--train-backend dp --no-offload-train --no-offload-rollout"),
)


@parametrize_cases(dry_cases(REPO_ROOT))
def test_dry(recipe_case, dry_run, check_static, plan_snapshot):
    dry = dry_run(recipe_case)
    check_static(dry)
    assert plan_snapshot == dry.text


@parametrize_cases([UNSHARDED])
def test_a_full_parameter_recipe_that_cannot_fit_fails_its_dry_check_naming_role_estimate_and_fix(
        recipe_case, dry_run):
    message = str(dry_run(recipe_case, expect_failure=True))
    assert "memory plan: each train GPU needs an estimated" in message, message
    assert "over its budget of 126.9 GiB (--gpu-memory-gb 141" in message, message
    assert "what would help: " in message and "--train-backend fsdp" in message, message
