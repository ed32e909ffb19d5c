# Shared by scripts/demo_deepspeed.sh and scripts/demo_megatron.sh (sourced, not run): the virtual
# environment, and a run killed with SIGKILL once it has printed a given line.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=.venv/bin/python

# ensure_venv IMPORTS DESCRIPTION INSTALL_FUNCTION: create .venv if missing; if `import IMPORTS` fails
# there, run INSTALL_FUNCTION (pip output goes to a log shown only on failure).
ensure_venv() {
    if [[ ! -x $PY ]]; then
        echo "==> creating .venv"
        python3 -m venv .venv
    fi
    if ! $PY -c "import $1" >/dev/null 2>&1; then
        echo "==> installing $2 into .venv"
        local log
        log="$(mktemp)"
        if ! "$3" >"$log" 2>&1; then
            cat "$log" >&2
            exit 1
        fi
        rm -f "$log"
    fi
}

# install_cpu_torch: torch 2.13.0, the CPU build this project is tested with, unless .venv has it. On Linux,
# PyPI's torch==2.13.0 is the CUDA build (~2.5 GB with its nvidia-* wheels): ask for the CPU build by name
# (2.13.0+cpu), from pip's configured indexes first (a local one, offline), else with PyTorch's CPU index
# added, as scripts/test.sh and scripts/demo.sh do. Installed first, it satisfies the torch the frameworks
# require: pip keeps it.
install_cpu_torch() {
    if $PY -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
        return 0
    fi
    $PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" ||
        $PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" \
            --extra-index-url https://download.pytorch.org/whl/cpu
}

# run_and_kill LOG PREFIX CMD...: run CMD in a process group of its own with its output in LOG, echo
# its lines that start with PREFIX ("[run 1] ..."), and SIGKILL the whole group once it prints
# KILL_LINE (a global: the start of the line to kill after). Exits 2 if CMD was not killed.
run_and_kill() {
    local log=$1 show=$2
    shift 2
    set -m  # a process group of its own: the kill takes its ranks and helper processes at once
    "$@" >"$log" 2>&1 &
    local pid=$!
    set +m
    while IFS= read -r line; do
        [[ $line =~ $show ]] && echo "[run 1] $line"
        if [[ $line == "$KILL_LINE"* ]]; then
            break
        fi
    done < <(tail -n +1 -f --pid="$pid" "$log")
    kill -KILL -- "-$pid" 2>/dev/null || true
    local status=0
    wait "$pid" || status=$?
    if [[ $status -ne 137 ]]; then
        echo "run 1 was not killed (exit status $status); FAIL"
        exit 2
    fi
}
