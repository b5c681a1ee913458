"""run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py"
LABELS = ('cosmos3', 'grpo', 'pickscore')
METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# two rollouts are too few for a reward trend: the signal that holds anywhere is a gradient
SIGNALS = (Signal("train/grad_norm", "positive"),)

CASES = [
    RecipeCase.cpu(RECIPE, metrics=METRICS, signals=SIGNALS, est_time=90, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=4, args=("--scale", "gpu-proxy"), est_time=1200, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
