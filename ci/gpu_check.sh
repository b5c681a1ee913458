#!/usr/bin/env bash
# The prepared GPU check (docs/ci.md, "GPU check"): on a machine with NVIDIA GPUs and nothing else
# prepared, install the repo and run GPU-tier cases through the nightly workflow's own runner
# (ci/run_suite.py, as .github/workflows/nightly-gpu.yml calls it), then print one table:
# case, parity max diff, pairs/s, peak GPU memory, wall time. Exit 0 when every case passed,
# 1 on any failure; without a GPU it prints "no GPU: skipped" and exits 0.
#
#   bash ci/gpu_check.sh                  # the default cases
#   GPU_CHECK_CASES="a-gpu b-gpu" bash ci/gpu_check.sh
#   GPU_CHECK_OUT=/tmp/gpu-check GPU_CHECK_SKIP_INSTALL=1 bash ci/gpu_check.sh
#   GPU_CHECK_WHEELS=/path/to/wheels bash ci/gpu_check.sh   # a GPU box without a package index
set -euo pipefail
cd "$(dirname "$0")/.."

count_gpus() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

GPUS="$(count_gpus)"
if [ "${GPUS:-0}" -lt 1 ]; then
    echo "no GPU: skipped"
    exit 0
fi

OUT="${GPU_CHECK_OUT:-ci-out/gpu-check}"
CASES="${GPU_CHECK_CASES:-run_diffusion_grpo_tiny_cpu-gpu run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned-gpu-1gpu run_diffusion_grpo_wan22_pickscore_5gpu-gpu-1gpu}"
export MILES_SCRIPT_MODEL_DIR="${MILES_SCRIPT_MODEL_DIR:-$PWD/models}"
mkdir -p "$OUT"

install() {
    if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
        # an air-gapped GPU image already holding torch: add only the wheels it lacks, beside the
        # image's own packages (--target), and run the repo from its checkout
        local site="${GPU_CHECK_SITE:-/tmp/miles-gpu-check-site}"
        python3 -m pip install -q --no-index --no-deps --target "$site" "$GPU_CHECK_WHEELS"/*.whl
        export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    else
        python3 -m pip install -q -e ".[test]"  # the nightly workflow's install step
    fi
}

[ -n "${GPU_CHECK_SKIP_INSTALL:-}" ] || install
nvidia-smi -L
python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -c "import ray, diffusers, transformers, peft, miles; print('ray', ray.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

status=0
# stage 1, no Ray: the tiny model's bf16 train step, parity probe, weight push and gradient
# checkpointing in process on the GPU (seconds; a broken GPU path shows here first)
MILES_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/unit/backends/test_compute_dtype.py::test_bf16_compute_keeps_parity_exact_with_fp32_master_weights \
    tests/unit/backends/test_gradient_checkpointing.py::test_gradients_are_equal_with_and_without_checkpointing \
    tests/unit/rollout/test_sde.py::test_a_samples_log_prob_does_not_depend_on_the_batch_it_is_computed_in \
    tests/unit/rollout/test_sde.py::test_the_host_step_equals_the_cpu_step_and_returns_on_the_models_device \
    || status=1

# stage 2: the recipes' GPU cases through the harness
case_args=()
for c in $CASES; do case_args+=(--case "$c"); done
start=$(date +%s)
# the nightly workflow's "Run the suite" step, restricted to these cases and this machine's GPUs
python3 ci/run_suite.py --tier gpu "${case_args[@]}" --gpus "$GPUS" --out "$OUT" || status=$?
echo "suite wall time: $(( $(date +%s) - start )) s"

python3 - "$OUT/results" $CASES <<'PY' || status=1
import json, sys
from pathlib import Path

results, cases = Path(sys.argv[1]), sys.argv[2:]
rows, failed = [], False
for name in cases:
    path = results / f"{name}.json"
    record = json.loads(path.read_text()) if path.is_file() else {"outcome": "not run"}
    passed = record.get("outcome") == "passed"
    failed |= not passed
    thr = (record.get("throughput") or {}).get("mean")
    mem = record.get("peak_memory")
    parity = record.get("parity_max_diff")  # the harness fails a run whose parity is not 0.0
    rows.append((name, record.get("outcome"), "-" if parity is None else repr(parity), f"{thr:.2f}" if thr else "-",
                 f"{mem / 2**30:.2f} GiB" if mem else "-", f"{record.get('wall_time', 0):.0f} s"))
header = ("case", "outcome", "parity max diff", "pairs/s", "peak GPU memory", "wall time")
widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
for row in [header] + rows:
    print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
sys.exit(1 if failed else 0)
PY
exit $status
