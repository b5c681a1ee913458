"""run_diffusion_grpo_wan22_pickscore_17gpu_multinode: the multi-node recipe.

CPU tier: the harness builds a two-node Ray cluster on loopback (a head and a worker, ports and
a temp dir of their own), runs the recipe's CPU proxy against it as an external cluster
(MILES_SCRIPT_EXTERNAL_RAY=1, RAY_ADDRESS = the head's job server) and tears both nodes down
afterwards. The proxy keeps its one train node (Ray places its actors over both nodes); with
`--num-nodes 2` the trainer created only half of its train ranks and hung (09:05 UTC, reported).

GPU tier (nightly): the recipe's documented CI proxy, one node of 4 GPUs (`--scale gpu-proxy`).
"""

from miles.testing.proxy_cases import proxy_cases, recipe_test

RECIPE = "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"
LABELS = ("wan22", "grpo", "pickscore", "multinode", "video")

CASES = proxy_cases(RECIPE, gpus=4, labels=LABELS, cpu_est_time=150, gpu_est_time=1500, cpu_options={"ray_nodes": 2})
test_recipe = recipe_test(CASES)
