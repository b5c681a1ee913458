"""run_diffusion_nft_sd3_pickscore: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_nft_sd3_pickscore.py"
LABELS = ('sd3', 'nft', 'pickscore', 'ema')

CASES = proxy_cases(RECIPE, gpus=3, labels=LABELS)
test_recipe = recipe_test(CASES)
