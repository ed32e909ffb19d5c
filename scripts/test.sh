#!/usr/bin/env bash
# Sets up the project's virtual environment (if needed) and runs the checks and the test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch is pinned: 2.13.0 is the CPU build this project tests against (an unpinned torch pulls a
# multi-GB CUDA build).
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# DeepSpeed builds from source against that torch: no build isolation (it would fetch another torch)
# and no compiled ops (DS_BUILD_OPS=0; the CPU tests need none ahead of time).
.venv/bin/python -m pip install -q --disable-pip-version-check setuptools wheel
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation deepspeed==0.19.8
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,frameworks]'
# Azurite, the real Azure Blob server the storage tests start (tests/servers.py), pinned by package-lock.json.
# npm ci only when node_modules was not installed from this very lock file.
if ! cmp -s package-lock.json node_modules/.tiercheck-installed-lock; then
    if ! command -v npm >/dev/null; then
        echo "scripts/test.sh: npm (Node.js 20 or newer) is needed to install Azurite for the storage tests" >&2
        exit 1
    fi
    npm ci --no-audit --no-fund --loglevel=error
    cp package-lock.json node_modules/.tiercheck-installed-lock
fi
.venv/bin/ruff check tiercheck tests examples bench
.venv/bin/mypy tiercheck
exec .venv/bin/python -m pytest "$@"
