"""run_diffusion_grpo_wan22_pickscore_5gpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py"
LABELS = ('wan22', 'grpo', 'pickscore', 'lora', 'video')
METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# two rollouts are too few for a reward trend: the signal that holds anywhere is a gradient
SIGNALS = (Signal("train/grad_norm", "positive"),)

CASES = [
    RecipeCase.cpu(RECIPE, metrics=METRICS, signals=SIGNALS, est_time=90, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=5, args=("--scale", "gpu-proxy"), est_time=1200, labels=LABELS),
    # the GPU check's case (ci/gpu_check.sh): rank, engine and PickScore share one GPU
    RecipeCase.gpu(RECIPE, gpus=1, args=("--scale", "1gpu-proxy"), variant="1gpu", signals=SIGNALS,
                   est_time=300, timeout=420, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
