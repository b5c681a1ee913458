#!/usr/bin/env bash
# The GPU check's wheelhouse (docs/ci.md): on a machine with a package index, download into DIR
# the wheels the GPU image lacks, for its Python, under the device's transfer limit. The check
# installs them there with no network: GPU_CHECK_WHEELS=DIR bash ci/gpu_check.sh
#
#   bash ci/gpu_wheels.sh .whl            # .whl: ignored by git, carried to the device
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: ci/gpu_wheels.sh DIR [--limit-mib N]" >&2; exit 2; }
exec python3 "$(dirname "$0")/gpu_wheels.py" "$@"
