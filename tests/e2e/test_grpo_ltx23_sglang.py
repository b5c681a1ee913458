"""run_diffusion_grpo_ltx23_sglang: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_grpo_ltx23_sglang.py"
LABELS = ('ltx', 'ltx2', 'grpo', 'pickscore', 'cps', 'video')

CASES = proxy_cases(RECIPE, gpus=5, labels=LABELS)
test_recipe = recipe_test(CASES)
