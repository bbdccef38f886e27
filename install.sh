#!/usr/bin/env bash
# Installs resilient-rl into the active Python environment.
#
#   ./install.sh          the trainer
#   ./install.sh dev      the trainer plus test dependencies
#   ./install.sh cluster  the trainer plus Ray's dashboard and job server (`ray job submit`);
#                         any extra of pyproject.toml, or several: ./install.sh hf,cluster
#
# torch is installed first so that the project's loose `torch` requirement is already met:
# a machine without an NVIDIA GPU gets the CPU build (small, quick), a GPU machine the
# regular build from the package index.
set -euo pipefail
cd "$(dirname "$0")"
extra="${1:-}"
TORCH_VERSION="${RRL_TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${RRL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

python -m pip install --upgrade pip >/dev/null
if python -c "import torch" 2>/dev/null; then
    echo "install.sh: using the installed torch $(python -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install.sh: NVIDIA GPU found, installing the CUDA build of torch"
    python -m pip install "torch>=2.6"
else
    echo "install.sh: no GPU found, installing the CPU build of torch ${TORCH_VERSION}"
    python -m pip install --timeout 20 --retries 1 --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
        || python -m pip install "torch==${TORCH_VERSION}"
fi
if [ -n "${extra}" ]; then
    python -m pip install -e ".[${extra}]"
else
    python -m pip install -e .
fi
