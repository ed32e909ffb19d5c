#!/usr/bin/env bash
# Megatron-core + tiercheck: kill a tensor-parallel training run (2 ranks, CPU) with SIGKILL at a random
# moment, start it again so it resumes from its newest finished checkpoint, and check that the result is
# bit-identical to an uninterrupted run. Creates .venv in the repo root if it is missing.
#
#   bash scripts/demo_megatron.sh            # a random kill moment
#   bash scripts/demo_megatron.sh 7          # replay one (the seed of the kill moment)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_lib.sh"
SEED="${1:-$RANDOM}"
STEPS=60
EVERY=10
SLEEP=0.1  # seconds per iteration of run 1, so that the kill lands mid-run
WORK="$ROOT/runs/demo-megatron"

install() {
    # torch pinned to the CPU build this project is tested with (demo_lib.sh); psutil is a dependency
    # megatron-core does not declare.
    install_cpu_torch &&
        $PY -m pip install --quiet --disable-pip-version-check megatron-core==0.16.1 psutil -e .
}
ensure_venv "tiercheck, megatron.core, psutil" "torch 2.13.0 (CPU), megatron-core 0.16.1, psutil and tiercheck (editable)" install

RANDOM=$SEED
KILL_AT=$((2 * EVERY + RANDOM % (STEPS * 3 / 4 - 2 * EVERY)))
rm -rf "$WORK"
mkdir -p "$WORK"
train=("$PY" -u examples/megatron_train.py "--steps=$STEPS" "--every=$EVERY")
echo "tiercheck + Megatron-core kill-and-resume demo (seed $SEED; replay: bash scripts/demo_megatron.sh $SEED)"

echo
echo "==> 1/4  reference run: no checkpoints, never interrupted"
"${train[@]}" "--out=$WORK/reference.pt" | sed 's/^/[reference] /'

echo
echo "==> 2/4  run 1: async checkpoints every $EVERY iterations in $WORK/ckpt; SIGKILL after iteration $KILL_AT"
KILL_LINE="step $KILL_AT "
run_and_kill "$WORK/run1.log" '' "${train[@]}" "--step-sleep=$SLEEP" "--ckpt-dir=$WORK/ckpt"
echo "==> KILLED run 1 with SIGKILL after iteration $KILL_AT"

echo
echo "==> 3/4  on disk after the kill"
for d in "$WORK"/ckpt/iter_*; do
    if [[ -f $d/metadata.json ]]; then
        echo "    $(basename "$d")/  finished: $(tr -d '\n' <"$d/tiercheck.json" | grep -o '"step": *[0-9]*') in $WORK/ckpt/local"
    else
        echo "    $(basename "$d")/  never finished (no metadata.json): ignored"
    fi
done
echo "    latest_checkpointed_iteration.txt: $(cat "$WORK/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)"

echo
echo "==> 4/4  run 2: the same command again; it resumes and finishes"
"${train[@]}" "--ckpt-dir=$WORK/ckpt" "--out=$WORK/resumed.pt" | sed 's/^/[run 2] /'

echo
echo "==> result"
$PY - "$WORK/reference.pt" "$WORK/resumed.pt" <<'EOF'
import sys

import torch

ref, got = (torch.load(p, weights_only=True) for p in sys.argv[1:3])
bad = [
    f"rank {r} {name}"
    for r, (a, b) in enumerate(zip(ref["ranks"], got["ranks"], strict=True))
    for name in a
    if not torch.equal(a[name], b[name])
]
n = sum(len(r) for r in ref["ranks"])
print(f"    final loss  reference {ref['final_loss']!r}, resumed {got['final_loss']!r}")
print(f"    {n - len(bad)}/{n} tensors (parameters and Adam state of both ranks) bit-identical")
if bad or ref["final_loss"] != got["final_loss"]:
    print(f"FAIL: differ: {bad}")
    sys.exit(1)
print("PASS: the killed and resumed run ends bit-identical to the uninterrupted one")
EOF
