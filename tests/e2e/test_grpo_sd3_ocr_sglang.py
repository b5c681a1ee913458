"""run_diffusion_grpo_sd3_ocr_sglang: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.
"""

from miles.testing import Signal
from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_grpo_sd3_ocr_sglang.py"
LABELS = ('sd3', 'grpo', 'ocr', 'lora')
# the OCR reward reads something at CPU scale, so the policy gets a gradient every step
SIGNALS = (Signal("train/grad_norm", "positive"), Signal("rollout/reward/raw_mean", "positive"))

CASES = proxy_cases(RECIPE, gpus=2, labels=LABELS, signals=SIGNALS)
test_recipe = recipe_test(CASES)
