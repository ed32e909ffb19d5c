#!/usr/bin/env bash
# The one command for a lent GPU machine (no network; Python 3.12, torch 2.11 CUDA), from the repo root:
#
#     bash bench/gpu_run.sh            # OUT=$OUT if set, else bench/results
#
# 1. installs the wheels carried in .whl/ (zarr and its deps, awscrt, tenacity, torch_checkpointing,
#    pytest-timeout: see bench/README.md, "GPU benchmark") into /tmp/site, byte-compiled as pip
#    installs them, and byte-compiles the checkout's tiercheck the same way: a fresh-process restore
#    then pays no library a compile that an installed one never pays;
# 2. prints the GPU, Python and torch versions, /dev/shm and the disk;
# 3. runs the CUDA tests (tests/test_cuda.py) -> $OUT/test_cuda.log;
# 4. runs bench/gpu_restart.py --out $OUT (a job restart with room on the GPU and with the GPU full,
#    issue 43; RESTART_ROUNDS rounds, default 2, within RESTART_BUDGET_S seconds, default 200)
#    -> $OUT/gpu-restart-<device>.json and $OUT/gpu_restart.log;
# 5. runs bench/gpu_bench.py --out $OUT -> $OUT/gpu-<device>.json and $OUT/gpu_bench.log,
#    whatever the tests gave. Extra arguments go to gpu_bench.py.
# Exit status: the first benchmark's that failed, or 3 when only the tests failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
SITE=/tmp/site

shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]} == 0)); then
    echo "no wheels in .whl/: nothing installed (zarr, awscrt, ... must already be importable)" >&2
elif python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
        || echo "pip install of the wheels FAILED" >&2
else  # no pip: a wheel is a zip of its site-packages files
    python3 - "$SITE" "${wheels[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
EOF
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m compileall -q tiercheck "$SITE" >/dev/null || echo "compileall failed" >&2

{
    nvidia-smi -L || echo "nvidia-smi failed"
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    python3 -c 'import zarr, numcodecs, awscrt, tenacity, tiercheck; print("zarr", zarr.__version__, "numcodecs", numcodecs.__version__, "tiercheck", tiercheck.__version__)' \
        || echo "IMPORT FAILED: tiercheck or its dependencies"
    python3 -c 'import torch_checkpointing, safetensors; print("torch_checkpointing ok, safetensors", safetensors.__version__)' \
        || echo "IMPORT FAILED: torch_checkpointing"
    df -h /dev/shm . || true
    echo "uid $(id -u); drop_caches writable: $([ -w /proc/sys/vm/drop_caches ] && echo yes || echo no)"
} 2>&1 | tee "$OUT/env.log"

# pyproject's pytest config turns warnings into errors (filterwarnings = error) and sets timeout = 600,
# which needs pytest-timeout (carried as a wheel): a newer package's warning on this machine fails a test.
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
tests_rc=$?

PYTHONUNBUFFERED=1 python3 bench/gpu_restart.py --out "$OUT" --rounds "${RESTART_ROUNDS:-2}" \
    --budget-s "${RESTART_BUDGET_S:-200}" 2>&1 | tee "$OUT/gpu_restart.log"
restart_rc=$?

PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=$?
echo "tests rc=$tests_rc, restart rc=$restart_rc, bench rc=$bench_rc" | tee -a "$OUT/gpu_bench.log"
if ((restart_rc != 0)); then exit "$restart_rc"; fi
if ((bench_rc != 0)); then exit "$bench_rc"; fi
if ((tests_rc != 0)); then exit 3; fi
exit 0
