"""run_diffusion_grpo_tiny_cpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.

The recipe has no --scale: it is CPU-sized already. Its CPU case starts its own Ray head
(own_head=True), so the full launcher path (head start, submission, teardown) is exercised on
every run of the suite; the other CPU cases share their worker's cluster. Its CPU tier is the recipe with two
rollouts; its nightly case is the recipe's default run (30 rollouts) on one GPU (`--device cuda`:
bfloat16 compute and rollout over float32 master weights), the GPU check's smoke test
(`ci/gpu_check.sh`): parity exactly 0.0 and the reward rising.
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_grpo_tiny_cpu.py"
LABELS = ('sd3', 'grpo', 'cpu-only')
METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# the brightness reward climbs from the first rollout (docs/testing.md, learning signals)
SIGNALS = (Signal("rollout/reward/raw_mean", "rises"),)

CASES = [
    RecipeCase.cpu(RECIPE, args=('--num-rollout', '2'), metrics=METRICS, own_head=True, signals=SIGNALS, est_time=90, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=1, args=('--num-rollout', '30', '--device', 'cuda'), signals=SIGNALS,
                   est_time=180, timeout=420, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
