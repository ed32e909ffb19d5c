#!/usr/bin/env bash
# Sets up the project's virtual environment (if needed) and runs the checks and the test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The setup's output (pip's, with every index warning of a machine whose pip has extra indexes) goes to a
# log, shown (its end, and where the rest is) only when a step fails.
setup_log="$(mktemp "${TMPDIR:-/tmp}/tiercheck-setup.XXXXXX.log")"
megatron_job="" shm_job=""
stop_background() {  # on a failed step, what runs in the background (below) stops too: a process group, or one
    for job in $megatron_job $shm_job; do kill -- -"$job" 2>/dev/null || kill "$job" 2>/dev/null || true; done
}
trap 'rm -f "$setup_log"; stop_background' EXIT
quietly() {  # quietly CMD...: one setup step, its output in $setup_log (kept when it fails)
    if ! "$@" >>"$setup_log" 2>&1; then
        tail -n 30 "$setup_log" >&2
        echo "scripts/test.sh: this setup step failed: $*" >&2
        echo "scripts/test.sh: its whole output, and the earlier steps': $setup_log" >&2
        trap stop_background EXIT
        exit 1
    fi
}
pip_install() { quietly .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
say() { echo "==> $*" >&2; }  # each step as it starts, on stderr: stdout is the checks' and the tests'
# Material for MkDocs prints a notice about its successor at every build, here and in tests/test_docs.py.
export NO_MKDOCS_2_WARNING=1
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    quietly python3 -m venv .venv
fi
# The Megatron lane's venv: megatron-core's current release (0.19, Python 3.12+) beside the main suite's 0.16
# on this Python. torch for 3.12 comes from PyPI as its CUDA build (~2.7 GB of wheels, a few minutes the first
# time; `import torch` needs no GPU): made in the background while the main venv is set up, kept and reused
# while these pins are unchanged. TIERCHECK_MEGATRON_LANE=0 leaves the lane out (it says so: nothing is counted
# as run).
megatron_pins="torch==2.13.0 megatron-core==0.19.2 psutil pytest pytest-timeout"
if [ "${TIERCHECK_MEGATRON_LANE:-1}" != 0 ]; then
    py312=""  # a working one: pyenv's shim exists even where 3.12 is not selected
    for candidate in "${TIERCHECK_PYTHON312:-python3.12}" "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            py312="$candidate"
            break
        fi
    done
    if [ -z "$py312" ]; then
        echo "scripts/test.sh: python3.12 is needed for the megatron-core 0.19 lane (pyenv install 3.12, or set" \
             "TIERCHECK_MEGATRON_LANE=0 to leave the lane out)" >&2
        exit 1
    fi
    megatron_log="$(mktemp "${TMPDIR:-/tmp}/tiercheck-megatron.XXXXXX.log")"
    if [ "$(cat .venv-megatron/.tiercheck-pins 2>/dev/null)" != "$megatron_pins" ]; then
        say "creating .venv-megatron in the background: torch 2.13.0 for Python 3.12 (the CUDA build: ~2.7 GB)" \
            "and megatron-core 0.19.2"
        # A process group of its own (setsid), so that a failed step stops pip too, not only its shell.
        group=setsid
        command -v setsid >/dev/null || group=""  # then a failed step stops its shell only
        $group bash -c 'set -e
            rm -rf .venv-megatron
            "$1" -m venv .venv-megatron
            .venv-megatron/bin/python -m pip install -q --disable-pip-version-check $2
            echo "$2" > .venv-megatron/.tiercheck-pins' _ "$py312" "$megatron_pins" >"$megatron_log" 2>&1 &
    else
        true &
    fi
    megatron_job=$!
fi
# torch is pinned to 2.13.0, the CPU build this project tests against. On Linux, PyPI's torch==2.13.0 is
# the CUDA build (~2.5 GB with its nvidia-* wheels): ask for the CPU build by name (2.13.0+cpu), from
# pip's configured indexes first (a local one, offline), else with PyTorch's CPU index added.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    say "installing torch 2.13.0 (the CPU build) into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" >>"$setup_log" 2>&1 \
        || pip_install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# DeepSpeed builds from source against that torch: no build isolation (it would fetch another torch)
# and no compiled ops (DS_BUILD_OPS=0; the CPU tests need none ahead of time).
say "installing DeepSpeed 0.19.8 (built from source against that torch, no compiled ops)"
pip_install setuptools wheel
quietly env DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
    deepspeed==0.19.8
# torchtitan 0.3.0 for tests/test_torchtitan.py, without its dependencies: its datasets pin would downgrade fsspec
# below s3fs's exact pin (and it pulls wandb, tensorboard, torch_checkpointing). Its checkpointer, optimizer and
# dataloader modules need only these.
say "installing torchtitan 0.3.0 and the modules it needs"
pip_install tyro==1.0.17 spmd_types==0.2.3 torchdata==0.11.0
pip_install --no-deps torchtitan==0.3.0
say "installing tiercheck (editable) with its test, frameworks and docs extras"
pip_install -e '.[test,frameworks,docs]'
# Azurite, the real Azure Blob server the storage tests start (tests/servers.py), pinned by package-lock.json.
# npm ci only when node_modules was not installed from this very lock file.
if ! cmp -s package-lock.json node_modules/.tiercheck-installed-lock; then
    if ! command -v npm >/dev/null; then
        echo "scripts/test.sh: npm (Node.js 20 or newer) is needed to install Azurite for the storage tests" >&2
        exit 1
    fi
    say "installing Azurite, the Azure Blob server the storage tests start (npm ci)"
    quietly npm ci --no-audit --no-fund --loglevel=error
    cp package-lock.json node_modules/.tiercheck-installed-lock
fi
# DeepSpeed's shared-memory op (~30 s of g++) is compiled in the background, beside the checks and the Megatron
# lane, where the suite's fixture finds it (pytest's cache, tests/conftest.py): it then compiles nothing. A
# failed build here costs nothing but the time: the fixture compiles it, and says why it cannot.
shm_cache=.pytest_cache/d/tiercheck-torch-extensions
shm_log="$(mktemp "${TMPDIR:-/tmp}/tiercheck-shm-op.XXXXXX.log")"
if [ -z "$(ls -A "$shm_cache" 2>/dev/null)" ]; then
    mkdir -p "$shm_cache"
    TORCH_EXTENSIONS_DIR="$root/$shm_cache" .venv/bin/python -c \
        "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >"$shm_log" 2>&1 &
    shm_job=$!
else
    true &
    shm_job=$!
fi
say "checking: ruff, mypy, import layers, the documentation site"
.venv/bin/ruff check tiercheck tests examples bench
.venv/bin/mypy tiercheck
# The package's layers point one way (pyproject.toml, [tool.importlinter]); its report (a logo, every
# contract KEPT) only when one is broken.
checks_log="$(mktemp)"
if ! .venv/bin/lint-imports --no-logo >"$checks_log" 2>&1; then
    cat "$checks_log" >&2
    echo "scripts/test.sh: lint-imports found an import against the layers (pyproject.toml)" >&2
    exit 1
fi
# The documentation site (docs/, mkdocs.yml): --strict fails on a broken link, anchor or reference;
# quiet unless it fails.
if ! .venv/bin/mkdocs build --strict --quiet --site-dir "$root/site" >"$checks_log" 2>&1; then
    cat "$checks_log" >&2
    echo "scripts/test.sh: mkdocs build --strict failed (docs/, mkdocs.yml)" >&2
    exit 1
fi
rm -f "$checks_log"

# The Megatron lane: megatron-core's current release (0.19, Python 3.12+) in a venv of its own, beside the
# main suite's 0.16 on this Python (its venv is made in the background, above: it is mostly download).
if [ "${TIERCHECK_MEGATRON_LANE:-1}" = 0 ]; then
    echo "scripts/test.sh: TIERCHECK_MEGATRON_LANE=0: the megatron-core 0.19 lane was NOT run" >&2
else
    if ! wait "$megatron_job"; then
        tail -n 30 "$megatron_log" >&2
        echo "scripts/test.sh: creating .venv-megatron failed; its whole output: $megatron_log" >&2
        exit 1
    fi
    rm -f "$megatron_log"
    say "installing tiercheck (editable) into .venv-megatron"
    quietly .venv-megatron/bin/python -m pip install -q --disable-pip-version-check -e .
    echo "== megatron-core 0.19 lane (Python 3.12): tests/test_megatron.py"
    .venv-megatron/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron.py
    echo "== main suite"
fi
wait "$shm_job" || echo "scripts/test.sh: DeepSpeed's shared-memory op did not build here (its tests build it):" \
    "$(tail -n 3 "$shm_log")" >&2
rm -f "$shm_log"
rm -f "$setup_log"  # exec runs no EXIT trap
# Two test processes (pytest-xdist), each taking whole files: most tests spend their time waiting on their ranks,
# servers and disks, so two share 2 cores well (CI's). TIERCHECK_TEST_WORKERS=0 runs the suite in this process
# (-n 0 as an argument does the same).
exec .venv/bin/python -m pytest -n "${TIERCHECK_TEST_WORKERS:-2}" --dist loadfile "$@"
