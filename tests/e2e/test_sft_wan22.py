"""run_diffusion_sft_wan22: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.

SFT has no rollout engines, so there is no train/rollout parity probe to assert (parity=False).
"""

from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_sft_wan22.py"
LABELS = ('wan22', 'sft', 'lora', 'video')

# each of the two rollouts trains on a different batch, so the loss of two steps has no trend
# (seen both ways across machines and sampler changes); a gradient at every step holds anywhere
CASES = proxy_cases(RECIPE, gpus=4, labels=LABELS, metrics=("train/loss", "train/grad_norm"), parity=False)
test_recipe = recipe_test(CASES)
