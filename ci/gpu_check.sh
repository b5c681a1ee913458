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
CASES="${GPU_CHECK_CASES:-run_diffusion_grpo_tiny_cpu-gpu run_diffusion_grpo_sd3_ocr_sglang-gpu run_diffusion_grpo_wan22_pickscore_5gpu-gpu}"
export MILES_SCRIPT_MODEL_DIR="${MILES_SCRIPT_MODEL_DIR:-$PWD/models}"
mkdir -p "$OUT"

if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
    python3 -m pip install -q -e ".[test]"  # the nightly workflow's install step
fi
nvidia-smi -L
python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

case_args=()
for c in $CASES; do case_args+=(--case "$c"); done
status=0
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
    # a passed run has parity exactly 0.0 at every rollout: the harness fails it otherwise
    rows.append((name, record.get("outcome"), "0.0" if passed else "-", f"{thr:.2f}" if thr else "-",
                 f"{mem / 2**30:.2f} GiB" if mem else "-", f"{record.get('wall_time', 0):.0f} s"))
header = ("case", "outcome", "parity max diff", "pairs/s", "peak GPU memory", "wall time")
widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
for row in [header] + rows:
    print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
sys.exit(1 if failed else 0)
PY
exit $status
