#!/usr/bin/env bash
# DeepSpeed + tiercheck: kill a ZeRO-2 training run (2 ranks, CPU) with SIGKILL at a random moment,
# start it again so it resumes from the newest committed checkpoint, and check that the result is
# bit-identical to an uninterrupted run. Creates .venv in the repo root if it is missing.
#
#   bash scripts/demo_deepspeed.sh            # a random kill moment
#   bash scripts/demo_deepspeed.sh 7          # replay one (the seed of the kill moment)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_lib.sh"
SEED="${1:-$RANDOM}"
STEPS=40
EVERY=5
SLEEP=0.15  # seconds per step of run 1, so that the kill lands mid-run
WORK="$ROOT/runs/demo-deepspeed"

install() {
    # torch pinned to the CPU build this project is tested with (demo_lib.sh); DeepSpeed built against
    # it, without build isolation (which would fetch another torch) and without compiled ops.
    install_cpu_torch &&
        $PY -m pip install --quiet --disable-pip-version-check setuptools wheel &&
        DS_BUILD_OPS=0 $PY -m pip install --quiet --disable-pip-version-check --no-build-isolation deepspeed==0.19.8 &&
        $PY -m pip install --quiet --disable-pip-version-check -e .
}
ensure_venv "tiercheck, deepspeed" "torch 2.13.0 (CPU), DeepSpeed 0.19.8 and tiercheck (editable)" install

RANDOM=$SEED
KILL_AT=$((2 * EVERY + RANDOM % (STEPS * 3 / 4 - 2 * EVERY)))
rm -rf "$WORK"
mkdir -p "$WORK"
# DeepSpeed compiles its shared-memory op into here, not the shared ~/.cache/torch_extensions: a run
# interrupted mid-compile leaves a lock file that would hang every later DeepSpeed use on the machine.
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
train=("$PY" -u examples/deepspeed_train.py "--steps=$STEPS" "--every=$EVERY")
quiet() { grep --line-buffered -E '^(step |RESUMED|tiercheck|Traceback|[A-Za-z.]*Error)' || true; }
echo "tiercheck + DeepSpeed kill-and-resume demo (seed $SEED; replay: bash scripts/demo_deepspeed.sh $SEED)"

echo
echo "==> 1/4  reference run: no checkpoints, never interrupted"
"${train[@]}" "--out=$WORK/reference.pt" 2>&1 | quiet | sed 's/^/[reference] /'

echo
echo "==> 2/4  run 1: engine.save_checkpoint every $EVERY steps through tiercheck; SIGKILL after step $KILL_AT"
KILL_LINE="step $KILL_AT "
run_and_kill "$WORK/run1.log" '^(step |RESUMED)' "${train[@]}" "--step-sleep=$SLEEP" "--ckpt-dir=$WORK/ckpt"
echo "==> KILLED run 1 with SIGKILL after step $KILL_AT"

echo
echo "==> 3/4  on disk after the kill"
echo "    $WORK/ckpt/deepspeed/latest: $(cat "$WORK/ckpt/deepspeed/latest" 2>/dev/null || echo none)"
echo "    each rank's node directory (tiercheck ls):"
"$PY" -m tiercheck ls "$WORK"/ckpt/node0 "$WORK"/ckpt/node1 | sed 's/^/    /' 

echo
echo "==> 4/4  run 2: the same command again; it resumes and finishes"
"${train[@]}" "--ckpt-dir=$WORK/ckpt" "--out=$WORK/resumed.pt" 2>&1 | quiet | sed 's/^/[run 2] /'

echo
echo "==> result"
$PY - "$WORK" <<'PYEOF'
import sys
from pathlib import Path

import torch

work = Path(sys.argv[1])


def flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


bad, n = [], 0
for rank in (0, 1):
    ref = dict(flat(torch.load(work / f"reference.pt.rank{rank}", weights_only=True)))
    got = dict(flat(torch.load(work / f"resumed.pt.rank{rank}", weights_only=True)))
    assert ref.keys() == got.keys()
    for name, a in ref.items():
        n += 1
        b = got[name]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not same:
            bad.append(f"rank {rank} {name}")
print(f"    {n - len(bad)}/{n} values (parameters, ZeRO fp32 partitions, Adam state, final loss) bit-identical")
if bad:
    print(f"FAIL: differ: {bad[:10]}")
    sys.exit(1)
print("PASS: the killed and resumed run ends bit-identical to the uninterrupted one")
PYEOF
