"""run_diffusion_grpo_tiny_cpu: the CPU proxy (two rollouts, metrics against the committed standard) and the
nightly GPU tier.

The recipe has no --scale: it is CPU-sized already. Its CPU case starts its own Ray head
(own_head=True), so the full launcher path (head start, submission, teardown) is exercised on
every run of the suite; the other CPU cases share their worker's cluster.

The CPU case also proves the numerics pins (miles/utils/numerics.py): it runs under a hostile
shell, every pinned setting set against its pin at once (an older CPU as torch would see it,
MKL's compatible path and AVX-512, oneDNN at any ISA, two threads, numpy's loops all on), and
must still reproduce its committed standard bit for bit with the pinned fingerprint. One run
proves both: the pins are assigned whatever value they replace, so a plain shell is a case of
the hostile one, and a second own-head run of the same recipe in a plain shell cost 40-50 s of
the suite while proving nothing this one does not. Its CPU tier is the recipe with two
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
HOSTILE_SHELL = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                 "ONEDNN_MAX_CPU_ISA": "ALL", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                 "NPY_DISABLE_CPU_FEATURES": ""}

CASES = [
    RecipeCase.cpu(RECIPE, args=('--num-rollout', '2'), metrics=METRICS, own_head=True, env=HOSTILE_SHELL,
                   signals=SIGNALS, est_time=90, labels=LABELS),
    # the GPU case's bfloat16 on CPU slots (issue 39), in the nightly CPU suite
    RecipeCase.rehearsal(RECIPE, args=('--num-rollout', '2', '--rehearsal', '--extra-args', '--stop-on-parity-drift'),
                         metrics=METRICS, signals=SIGNALS, est_time=90, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=1, args=('--num-rollout', '30', '--device', 'cuda', '--extra-args',
                                         '--stop-on-parity-drift'), signals=SIGNALS,
                   est_time=180, timeout=420, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    run = run_recipe(recipe_case)
    if recipe_case.tier == "cpu":  # the shell said otherwise; the pins won
        fingerprint = run.run_json["fingerprint"]
        assert fingerprint["torch_cpu_capability"] == "AVX2"
        assert fingerprint["torch_threads"] == 1
        assert fingerprint["numerics"]["ATEN_CPU_CAPABILITY"] == "avx2"
    check_run(run)
