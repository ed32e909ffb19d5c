#!/usr/bin/env bash
# Quick start: kill a training run at a random moment, resume it (from tiercheck's memory tier on
# /dev/shm: the step, the tier and the restart time against the local directory are shown), and check
# the result is bit-identical to an uninterrupted run. Creates .venv in the repo root if it is missing.
#
#   bash scripts/demo.sh              # arguments are passed on to examples/demo.py
#   bash scripts/demo.sh --seed 7     # replay one kill moment
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ ! -x .venv/bin/python ]]; then
    echo "==> creating .venv"
    python3 -m venv .venv
fi

echo "==> installing torch 2.13.0 (CPU) and tiercheck (editable) into .venv (first time: a few minutes)"
# pip's and the build backend's chatter goes to a log that is shown only if the install fails.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
pip_install() {
    if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "pip install $* failed" >&2
        exit 1
    fi
}
# torch is pinned to 2.13.0, the CPU build this project is tested with. On Linux, PyPI's torch==2.13.0
# is the CUDA build (~2.5 GB with its nvidia-* wheels): ask for the CPU build by name (2.13.0+cpu), from
# pip's configured indexes first (a local one, offline), else with PyTorch's CPU index added.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" >>"$log" 2>&1 \
        || pip_install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
pip_install -e .

echo "==> running examples/demo.py"
.venv/bin/python examples/demo.py "$@"
