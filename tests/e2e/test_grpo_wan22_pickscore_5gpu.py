"""run_diffusion_grpo_wan22_pickscore_5gpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing.proxy_cases import one_gpu_check_case, proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py"
LABELS = ('wan22', 'grpo', 'pickscore', 'lora', 'video')

CASES = proxy_cases(RECIPE, gpus=5, labels=LABELS) + [one_gpu_check_case(RECIPE, LABELS)]
test_recipe = recipe_test(CASES)
