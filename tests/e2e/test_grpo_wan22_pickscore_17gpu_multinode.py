"""run_diffusion_grpo_wan22_pickscore_17gpu_multinode: the multi-node recipe.

CPU tier: the harness builds a two-node Ray cluster on loopback (a head and a worker, ports and
a temp dir of their own), runs the recipe's CPU proxy against it as an external cluster
(MILES_SCRIPT_EXTERNAL_RAY=1, RAY_ADDRESS = the head's job server) and tears both nodes down
afterwards. The proxy keeps its one train node (Ray places its actors over both nodes); with
`--num-nodes 2` the trainer created only half of its train ranks and hung (09:05 UTC, reported).

GPU tier (nightly): the recipe's documented CI proxy, one node of 4 GPUs (`--scale gpu-proxy`).
"""

from miles.testing import RecipeCase, Signal, parametrize_cases

RECIPE = "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"
LABELS = ("wan22", "grpo", "pickscore", "multinode", "video")
METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# two rollouts are too few for a reward trend: the signal that holds anywhere is a gradient
SIGNALS = (Signal("train/grad_norm", "positive"),)

CASES = [
    RecipeCase.cpu(RECIPE, ray_nodes=2, metrics=METRICS, signals=SIGNALS,
                   est_time=150, labels=LABELS),
    RecipeCase.gpu(RECIPE, gpus=4, args=("--scale", "gpu-proxy"), est_time=1500, labels=LABELS),
]


@parametrize_cases(CASES)
def test_recipe(recipe_case, run_recipe, check_run):
    check_run(run_recipe(recipe_case))
