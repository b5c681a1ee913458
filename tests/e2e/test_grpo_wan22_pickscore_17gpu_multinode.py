"""run_diffusion_grpo_wan22_pickscore_17gpu_multinode: the multi-node recipe.

CPU tier: the harness builds a two-node Ray cluster on loopback (a head and a worker, ports and
a temp dir of their own), runs the recipe's CPU proxy against it as an external cluster
(MILES_SCRIPT_EXTERNAL_RAY=1, RAY_ADDRESS = the head's job server) and tears both nodes down
afterwards. The proxy keeps its one train node (Ray places its actors over both nodes); with
`--num-nodes 2` the trainer created only half of its train ranks and hung (09:05 UTC, reported).

GPU tier (nightly): the recipe's documented CI proxy, one node of 4 GPUs (`--scale gpu-proxy`), and
the GPU check's case (`--scale 1gpu-proxy`, ci/gpu_check.sh): the Wan2.2 full fine-tune on one GPU.

Its CPU cases are rehearsals, both in the README's test command (issue 39): Wan2.2 keeps modules in
float32 under bfloat16, the family where engine, trainer and push once disagreed. `cpu-rehearsal`
is the GPU proxy's configuration (bfloat16 over float32 masters, data-parallel, every weight pushed
in buckets, gradient checkpointing) on the two-node loopback cluster; `cpu-rehearsal-fsdp` is the
full run's backend (FSDP2 over 2 gloo ranks, both sides offloaded). Each stops at the first rollout
whose parity is not exactly 0.0. (The float32 CPU proxy this recipe had is what the 5-GPU Wan2.2
recipe's CPU case still proves.)
"""

from miles.testing import RecipeCase
from miles.testing.proxy_cases import GRADIENT_SIGNALS, one_gpu_check_case, recipe_test, rehearsal_case

RECIPE = "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"
LABELS = ("wan22", "grpo", "pickscore", "multinode", "video")

CASES = [
    rehearsal_case(RECIPE, LABELS, ray_nodes=2, suites=("cpu", "nightly-cpu")),
    rehearsal_case(RECIPE, LABELS, scale="cpu-rehearsal-fsdp", variant="rehearsal-fsdp", suites=("cpu", "nightly-cpu")),
    RecipeCase.gpu(RECIPE, gpus=4, args=("--scale", "gpu-proxy", "--extra-args", "--stop-on-parity-drift"),
                   est_time=1500, labels=LABELS, signals=GRADIENT_SIGNALS),
    one_gpu_check_case(RECIPE, LABELS),  # ci/gpu_check.sh's Wan2.2 full fine-tune
]
test_recipe = recipe_test(CASES)
