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
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/ruff check tiercheck tests examples bench
.venv/bin/mypy tiercheck
exec .venv/bin/python -m pytest "$@"
