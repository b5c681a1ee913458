"""A recipe whose memory plan cannot fit its GPUs fails its dry check before anything starts."""

from pathlib import Path

from miles.testing import RecipeCase, parametrize_cases

REPO_ROOT = Path(__file__).resolve().parents[2]

# The full-parameter Wan2.2 A14B recipe with its sharding and offload taken away: every train
# rank would hold a whole float32 master, a bf16 copy and AdamW state of both experts beside its
# engine. Its dry check must fail for memory, naming the GPU, the estimate, the budget and the fix.
UNSHARDED = RecipeCase.dry(
    "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py", root=REPO_ROOT, variant="unsharded",
    args=("--extra-args", "--train-backend dp --no-offload-train --no-offload-rollout"),
)


@parametrize_cases([UNSHARDED])
def test_a_full_parameter_recipe_that_cannot_fit_fails_its_dry_check_naming_role_estimate_and_fix(
        recipe_case, dry_run):
    message = str(dry_run(recipe_case, expect_failure=True))
    assert "memory plan: each train GPU needs an estimated" in message, message
    assert "over its budget of 126.9 GiB (--gpu-memory-gb 141" in message, message
    assert "what would help: " in message and "--train-backend fsdp" in message, message
