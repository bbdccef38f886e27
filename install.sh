#!/usr/bin/env bash
# Installs resilient-rl into the active Python environment.
#
#   ./install.sh                          the trainer
#   ./install.sh dev                      the trainer plus test dependencies
#   ./install.sh cluster                  the trainer plus Ray's dashboard and job server (`ray job submit`);
#                                         any extra of pyproject.toml, or several: ./install.sh hf,cluster
#   ./install.sh --wheelhouse DIR [dev]   the same from a folder of wheels, with no package index
#                                         (an air-gapped cluster; fill DIR with scripts/fill_wheelhouse.sh)
#
# torch is installed first so that the project's loose `torch` requirement is already met:
# a machine without an NVIDIA GPU gets the CPU build (small, quick), a GPU machine the
# regular build from the package index (or the wheelhouse's).
set -euo pipefail
cd "$(dirname "$0")"
wheelhouse=""
if [ "${1:-}" = "--wheelhouse" ]; then
    wheelhouse="${2:?--wheelhouse needs a folder of wheels}"
    [ -d "$wheelhouse" ] || { echo "install.sh: --wheelhouse $wheelhouse is not a folder" >&2; exit 2; }
    shift 2
fi
extra="${1:-}"
TORCH_VERSION="${RRL_TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${RRL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PY="$(command -v python || command -v python3)"
target="."
[ -n "${extra}" ] && target=".[${extra}]"

if [ -n "$wheelhouse" ]; then
    # Nothing is fetched: every requirement comes from the wheelhouse or is installed already.
    offline=(--no-index --find-links "$wheelhouse")
    if ! "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m pip install "${offline[@]}" torch
    fi
    echo "install.sh: installing from the wheelhouse $wheelhouse (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
    # The project is built here, without an isolated build environment: first the build
    # requirements of pyproject.toml (kept as installed where they already satisfy it).
    "$PY" -m pip install "${offline[@]}" "setuptools>=77" wheel
    "$PY" -m pip install "${offline[@]}" --no-build-isolation -e "$target"
    exit 0
fi

"$PY" -m pip install --upgrade pip >/dev/null
if "$PY" -c "import torch" 2>/dev/null; then
    echo "install.sh: using the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install.sh: NVIDIA GPU found, installing the CUDA build of torch"
    "$PY" -m pip install "torch>=2.6"
else
    echo "install.sh: no GPU found, installing the CPU build of torch ${TORCH_VERSION}"
    "$PY" -m pip install --timeout 20 --retries 1 --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
        || "$PY" -m pip install "torch==${TORCH_VERSION}"
fi
"$PY" -m pip install -e "$target"
