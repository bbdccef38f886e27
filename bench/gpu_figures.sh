#!/usr/bin/env bash
# Every GPU figure of the project in one command, on one GPU (about 8 minutes on an H100):
#
#   bash bench/gpu_figures.sh [--wheelhouse DIR] [OUT]
#
# With --wheelhouse, first installs the project from DIR with no package index
# (`./install.sh --wheelhouse DIR`). Logs and a summary go to OUT (default: ./gpu-figures).
#   1. gsm8k-0.5b: update, log-prob and whole-step MFU (the project's count and verl's), end-to-end
#      tokens/s/GPU, decode compiles and graph breaks, one actor SIGKILL's recovery time, and the
#      rollout engine against HF generate with the engine's share of the decode roofline;
#   2. gsm8k-1.5b: the same but the generation comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheelhouse" ]; then
    ./install.sh --wheelhouse "${2:?--wheelhouse needs a folder}" || exit 1
    shift 2
fi
out="${1:-${OUT:-gpu-figures}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY="$(command -v python || command -v python3)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$PY" -c "import torch, transformers, ray; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)" | tee -a "$out/gpu.txt"
status=0
run() {  # name, timeout, arguments of bench/gpu.py
    local name=$1 limit=$2
    shift 2
    echo "== $name: python bench/gpu.py $*" | tee -a "$out/summary.txt"
    timeout "$limit" "$PY" bench/gpu.py "$@" > "$out/$name.log" 2>&1
    local rc=$?
    grep -E "^(workload|  |tokens/s|MFU|decode step|recovery|steps in|generation|GPU [0-9]|first checkpoint|warm-up)|memory plan:" \
        "$out/$name.log" | tee -a "$out/summary.txt"
    echo "rc=$rc" | tee -a "$out/summary.txt"
    [ $rc = 0 ] || { status=1; tail -30 "$out/$name.log"; }
}
run gsm8k-0.5b 200 --workload gsm8k-0.5b --warmup 1 --steps 2 --generation-paths engine,hf_dynamic
run gsm8k-1.5b 200 --workload gsm8k-1.5b --warmup 1 --steps 2 --skip-generation
exit $status
