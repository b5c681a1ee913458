#!/usr/bin/env bash
# The prepared GPU check (docs/ci.md, "GPU check"): its whole verdict in one call of a few minutes
# on one GPU. Install (from a wheelhouse without a network, or from the index), make the cases'
# proxy checkpoints while the install and the in-process GPU tests run, then run the GPU cases
# AT THE SAME TIME on the one GPU through the nightly runner (ci/run_suite.py on one Ray cluster,
# the device split into shares and packed by each case's memory, ci/gpu_shares.py), and print one
# table: case, outcome, parity max diff, pairs/s, peak GPU memory, wall time. Exit 0 when every
# case passed, 1 on any failure; without a GPU it prints "no GPU: skipped" and exits 0.
#
#   bash ci/gpu_check.sh                                  # on the GPU machine
#   GPU_CHECK_WHEELS=.whl bash ci/gpu_check.sh            # no index there: wheels from ci/gpu_wheels.sh
#   bash ci/gpu_check.sh --rehearse-cpu                   # here: the same cases at their CPU shapes,
#                                                         # concurrently, on a logical GPU
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
    "") ;;
    --rehearse-cpu) MODE=cpu ;;
    *) echo "ci/gpu_check.sh: unknown argument '$1' (the only one is --rehearse-cpu)" >&2; exit 2 ;;
esac

T0=$(date +%s)
say() { echo "[gpu-check +$(( $(date +%s) - T0 ))s] $*"; }

count_gpus() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

if [ "$MODE" = gpu ] && [ "$(count_gpus)" -lt 1 ]; then
    echo "no GPU: skipped"
    exit 0
fi

OUT="$(realpath -m "${GPU_CHECK_OUT:-ci-out/gpu-check-$MODE}")"
# the harness's checkpoint cache for every case (it ignores MILES_SCRIPT_MODEL_DIR)
export MILES_TEST_MODEL_DIR="${MILES_TEST_MODEL_DIR:-$PWD/models/gpu-check}"
mkdir -p "$OUT" "$MILES_TEST_MODEL_DIR"
rm -rf "$OUT/results" "$OUT/logs" "$OUT/junit"

SITE="${GPU_CHECK_SITE:-/tmp/miles-gpu-check-site}"
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    # the wheels go beside the image's own packages (--target), and the repo runs from its checkout
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi

install_wheels() {  # $1: wheel paths in the wheelhouse
    # --upgrade: the second batch's bin/ (Ray's scripts) replaces the first's (diffusers-cli, unused)
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $1
}

# the wheels the checkpoint makers need go first, so the checkpoints start while the rest installs
install_first() {
    if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
        install_wheels "$(ls "$GPU_CHECK_WHEELS"/diffusers-*.whl "$GPU_CHECK_WHEELS"/importlib_metadata-*.whl)"
    else
        python3 -m pip install -q diffusers
    fi
}

install_rest() {
    if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
        local rest
        rest="$(ls "$GPU_CHECK_WHEELS"/*.whl | grep -v -e '/diffusers-' -e '/importlib_metadata-')"
        install_wheels "$rest"
    else
        python3 -m pip install -q -e ".[test]"  # the nightly workflow's install step
    fi
}

status=0
if [ "$MODE" = gpu ] && [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
    install_first
    say "first wheels installed"
fi

python3 ci/gpu_check.py assets --scale "$MODE" > "$OUT/assets.log" 2>&1 &
ASSETS=$!

if [ "$MODE" = gpu ]; then
    [ -n "${GPU_CHECK_SKIP_INSTALL:-}" ] || install_rest
    say "installed"
    nvidia-smi -L
    python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python3 -c "import ray, diffusers, transformers, peft, miles; print('ray', ray.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
    # stage 1, no Ray, beside the checkpoint makers: the tiny model's bf16 train step, parity
    # probe, weight push and gradient checkpointing in process on the GPU (a broken GPU path
    # shows here first), and FSDP2 with one rank over the cpu:gloo,cuda:nccl group (bf16 LoRA,
    # two rollouts with the weight push between them, parity exactly 0.0)
    MILES_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/unit/backends/test_compute_dtype.py::test_bf16_compute_keeps_parity_exact_with_fp32_master_weights \
        tests/unit/backends/test_fsdp.py::test_sharded_lora_with_bf16_compute_keeps_parity_exact_without_a_compute_copy \
        tests/unit/backends/test_gradient_checkpointing.py::test_gradients_are_equal_with_and_without_checkpointing \
        tests/unit/rollout/test_sde.py::test_a_samples_log_prob_does_not_depend_on_the_batch_it_is_computed_in \
        tests/unit/rollout/test_sde.py::test_the_host_step_equals_the_cpu_step_and_returns_on_the_models_device \
        || status=1
    # the colocated weight push through CUDA IPC, the recipes' own path (miles.backends.ipc_push;
    # stage 2's colocated cases push through it too): every weight bit for bit from one reused buffer
    python3 ci/ipc_push_probe.py --device cuda || status=1
    say "stage 1 done"
    # NOT YET HERE (docs/ci.md, "What one GPU could check next"): an offload round trip of one
    # rank on the device.
    # HOOK (issue 25): the full-scale replay on the real device goes here once it lands: the
    # replay's phases with real CUDA allocations on a proxy, measured peak against the plan.
fi

wait "$ASSETS" || { status=1; say "making the checkpoints failed:"; tail -20 "$OUT/assets.log"; }
cat "$OUT/assets.log"
say "checkpoints ready"

# stage 2: every case at once on the one GPU, through the nightly runner on one Ray cluster
suite_start=$(date +%s)
python3 ci/gpu_check.py run --scale "$MODE" --out "$OUT" || status=1
say "suite wall time: $(( $(date +%s) - suite_start )) s"

python3 ci/gpu_check.py table --scale "$MODE" --out "$OUT" || status=1
say "total wall time: $(( $(date +%s) - T0 )) s (exit $status)"
exit $status
