"""run_diffusion_sft_wan22: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.

SFT has no rollout engines, so there is no train/rollout parity probe to assert (parity=False).
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_sft_wan22.py"
LABELS = ('wan22', 'sft', 'lora', 'video')
METRICS = ("train/loss", "train/grad_norm")
# each of the two rollouts trains on a different batch, so the loss of two steps has no trend
# (seen both ways across machines and sampler changes); a gradient at every step holds anywhere
SIGNALS = (Signal("train/grad_norm", "positive"),)

CASES = [
    RecipeCase.cpu(RECIPE, metrics=METRICS, signals=SIGNALS, est_time=90, labels=LABELS, parity=False),
    RecipeCase.gpu(RECIPE, gpus=4, args=("--scale", "gpu-proxy"), est_time=1200, labels=LABELS, parity=False),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
