"""run_diffusion_grpo_sd3_ocr_sglang: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_grpo_sd3_ocr_sglang.py"
LABELS = ('sd3', 'grpo', 'ocr', 'lora')
METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# the OCR reward reads something at CPU scale, so the policy gets a gradient every step
SIGNALS = (Signal("train/grad_norm", "positive"), Signal("rollout/reward/raw_mean", "positive"))

CASES = [
    RecipeCase.cpu(RECIPE, metrics=METRICS, signals=SIGNALS, est_time=90, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=2, args=("--scale", "gpu-proxy"), est_time=1200, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
