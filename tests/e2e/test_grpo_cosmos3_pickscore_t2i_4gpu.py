"""run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py"
LABELS = ('cosmos3', 'grpo', 'pickscore')

CASES = proxy_cases(RECIPE, gpus=4, labels=LABELS)
test_recipe = recipe_test(CASES)
