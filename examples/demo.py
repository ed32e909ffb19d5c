"""Kill a training run at a random moment, restart it, and show the result is bit-identical.

1. Train ``examples/train.py`` uninterrupted, without checkpoints: the reference.
2. Train it again with ``--ckpt-dir``, and SIGKILL it at a random moment once at least one
   checkpoint has had time to commit (as a crashed node would die: no cleanup, no final save).
3. Show what the kill left on disk: committed steps, and any partial step without ``COMMIT``.
4. Start the same command again: it restores the newest committed step and finishes.
5. Compare the two final results tensor by tensor with ``torch.equal``: PASS or FAIL.

    python examples/demo.py                # or: bash scripts/demo.sh
    python examples/demo.py --seed 7       # replay one kill moment

Exits 0 on PASS, 1 on FAIL, 2 when a run could not be carried out at all.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
try:
    import tiercheck
except ImportError:  # running from a checkout where tiercheck is not installed
    sys.path.insert(0, str(REPO))
    import tiercheck

TRAIN = REPO / "examples" / "train.py"
STEP_LINE = re.compile(r"^step (\d+) loss ")
RESUMED_LINE = re.compile(r"^RESUMED from checkpoint step (\d+)")

_print_lock = threading.Lock()
_children: list[Child] = []  # killed on Ctrl-C: in their own sessions, they would not see it


def say(line: str = "") -> None:
    with _print_lock:
        print(line, flush=True)


def banner(text: str) -> None:
    say()
    say(f"==> {text}")


class Child:
    """A ``train.py`` process whose output is streamed, prefixed, while it is watched."""

    def __init__(self, label: str, args: Sequence[str]) -> None:
        self.label = label
        self.lines: list[str] = []
        self.last_step: int | None = None
        self.step_times: list[float] = []  # when each step line arrived
        self._target: int | None = None
        self.reached = threading.Event()
        env = dict(os.environ)
        # Let the child import tiercheck from this checkout even where it is not installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-u", str(TRAIN), *args]
        say(f"    $ python {_shown(TRAIN)} {' '.join(args)}")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            # Its own process group, so a kill takes down every thread and any helper process
            # at once, as a node failure would.
            start_new_session=True,
        )
        _children.append(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            say(f"[{self.label}] {line}")
            m = STEP_LINE.match(line)
            if m:
                self.last_step = int(m.group(1))
                self.step_times.append(time.monotonic())
                if self._target is not None and self.last_step >= self._target:
                    self.reached.set()
        self.reached.set()  # end of output: nobody should wait any longer

    def wait_for_step(self, target: int) -> None:
        """Block until the child has printed step ``target`` (or has exited)."""
        self._target = target
        if self.last_step is not None and self.last_step >= target:
            self.reached.set()
        self.reached.wait()

    def seconds_per_step(self) -> float:
        t = self.step_times[-20:]
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.05

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self) -> int:
        rc = self.proc.wait()
        self._reader.join(timeout=10)
        return rc

    def matches(self, pattern: re.Pattern[str]) -> list[int]:
        return [int(m.group(1)) for line in self.lines if (m := pattern.match(line))]


def _shown(path: Path) -> str:
    """``path`` relative to the current directory where it lies below it, for shorter lines."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def show_disk(ckpt_dir: Path) -> list[int]:
    """Print what is in the checkpoint directory; return the committed steps."""
    committed: list[int] = []
    entries = sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    if not entries:
        say("    (empty)")
    for entry in entries:
        if entry.is_dir() and re.fullmatch(r"step-\d{8}", entry.name):
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            if (entry / "COMMIT").exists():
                committed.append(int(entry.name[5:]))
                verdict = "COMMIT present: committed"
            else:
                verdict = "no COMMIT: partial, will be ignored"
            say(f"    {entry.name}/  {size / 2**20:6.2f} MiB on disk (all its files)  {verdict}")
        else:
            kind = "dir " if entry.is_dir() else "file"
            say(f"    {entry.name}{'/' if entry.is_dir() else ''}  ({kind}, not a step)")
    return committed


def compare(ref: Any, got: Any, path: str, problems: list[str]) -> int:
    """Compare nested containers exactly; return the number of tensors compared."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            problems.append(f"{path}: tensor vs {type(got).__name__}")
        elif ref.dtype != got.dtype or ref.shape != got.shape:
            problems.append(f"{path}: {ref.dtype}{list(ref.shape)} vs {got.dtype}{list(got.shape)}")
        elif not torch.equal(ref, got):
            diff = (ref.double() - got.double()).abs().max().item()
            problems.append(f"{path}: values differ (max abs diff {diff:.3g})")
        return 1
    if isinstance(ref, dict) and isinstance(got, dict):
        if set(ref) != set(got):
            problems.append(f"{path}: keys differ: {sorted(map(str, set(ref) ^ set(got)))}")
        return sum(compare(ref[k], got[k], f"{path}.{k}", problems) for k in ref if k in got)
    if isinstance(ref, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(ref) != len(got):
            problems.append(f"{path}: length {len(ref)} vs {len(got)}")
        pairs = enumerate(zip(ref, got, strict=False))  # a length mismatch is reported above
        return sum(compare(a, b, f"{path}[{i}]", problems) for i, (a, b) in pairs)
    if ref != got:
        problems.append(f"{path}: {ref!r} vs {got!r}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for the kill moment (default: a random one, printed for replay)",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--every", type=int, default=10, help="checkpoint interval (default 10)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per training step (default 0)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "runs" / "demo",
        help="where checkpoints and results go (default runs/demo in the repo)",
    )
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < 4 * args.every:
        p.error("need --every >= 1 and --steps >= 4 * --every (room for a kill after a commit)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10_000)
    rng = random.Random(seed)
    t_start = time.monotonic()

    workdir: Path = args.workdir.resolve()
    ckpt_dir = workdir / "ckpt"
    ref_out, resumed_out = workdir / "reference.pt", workdir / "resumed.pt"
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # start from nothing: only this demo writes here
    for f in (ref_out, resumed_out):
        f.unlink(missing_ok=True)

    common = [f"--steps={args.steps}", f"--every={args.every}"]
    if args.step_sleep:
        common.append(f"--step-sleep={args.step_sleep}")
    # Kill once step `kill_after` has printed, plus a random part of one checkpoint interval,
    # so the kill lands anywhere: mid-step, mid-save, between saves. By then the save of step
    # `kill_after - every` (at least) has had a whole interval to commit.
    kill_after = rng.randint(2 * args.every, args.steps * 3 // 4)
    kill_fraction = rng.random()
    say(f"tiercheck kill-and-resume demo (seed {seed}; replay with --seed {seed})")
    say(f"work directory: {workdir}")

    banner("1/4  reference run: no checkpoints, never interrupted")
    ref = Child("reference", [*common, f"--out={_shown(ref_out)}"])
    if (rc := ref.finish()) != 0:
        say(f"reference run failed with exit code {rc}")
        return 2

    banner(
        f"2/4  run 1: checkpoints every {args.every} steps in {_shown(ckpt_dir)}; SIGKILL soon after step {kill_after}"
    )
    run1 = Child("run 1", [*common, f"--ckpt-dir={_shown(ckpt_dir)}"])
    try:
        run1.wait_for_step(kill_after)
        delay = kill_fraction * args.every * run1.seconds_per_step()
        time.sleep(delay)
        at_step = run1.last_step
        run1.kill()
    finally:
        run1.kill()
        rc = run1.finish()
    if rc != -signal.SIGKILL:
        say(f"run 1 ended on its own (exit code {rc}) before it could be killed")
        return 2
    say(
        f"==> KILLED run 1 with SIGKILL {delay * 1e3:.0f} ms after step {kill_after}; "
        f"its last printed step was {at_step}"
    )

    banner(f"3/4  on disk after the kill ({_shown(ckpt_dir)})")
    committed = show_disk(ckpt_dir)
    problems: list[str] = []
    if committed:
        try:
            latest = tiercheck.load(ckpt_dir)
            say(f"    tiercheck.load(): newest committed step holds progress {latest['progress']}")
        except Exception as exc:  # a demo: report any failure and carry on with the others
            problems.append(f"tiercheck.load({ckpt_dir}) raised {exc!r}")
            say(f"    tiercheck.load() FAILED: {exc!r}")
    else:
        say("    nothing committed yet: run 2 will start from scratch (still must match)")

    banner("4/4  run 2: the same command again; it restores and finishes")
    run2_args = [*common, f"--ckpt-dir={_shown(ckpt_dir)}", f"--out={_shown(resumed_out)}"]
    run2 = Child("run 2, resumed", run2_args)
    if (rc := run2.finish()) != 0:
        say(f"run 2 failed with exit code {rc}")
        return 2

    banner("result")
    resumed_from = run2.matches(RESUMED_LINE)
    if committed:
        if resumed_from != [max(committed)]:
            problems.append(
                f"run 2 resumed from {resumed_from or 'nothing'}, "
                f"but the newest committed step on disk was {max(committed)}"
            )
        else:
            say(
                f"    run 2 resumed from step {resumed_from[0]}, the newest committed step, "
                f"and ran steps {resumed_from[0] + 1}..{args.steps - 1}"
            )
    ref_res = torch.load(ref_out, weights_only=True)
    got_res = torch.load(resumed_out, weights_only=True)

    loss_ref, loss_got = ref_res["final_loss"], got_res["final_loss"]
    say(f"    final loss   reference {loss_ref:.9f} ({float(loss_ref).hex()})")
    say(f"                 resumed   {loss_got:.9f} ({float(loss_got).hex()})")
    if loss_ref != loss_got:
        problems.append(f"final loss differs: {loss_ref!r} vs {loss_got!r}")

    n_params = compare(ref_res["params"], got_res["params"], "params", problems)
    n_opt = compare(ref_res["optimizer"], got_res["optimizer"], "optimizer", problems)
    n_bad = sum(p.startswith(("params", "optimizer")) for p in problems)
    say(
        f"    parameters   {n_params} tensors, optimizer state {n_opt} tensors: "
        f"{'all bit-identical (torch.equal)' if n_bad == 0 else f'{n_bad} MISMATCHES'}"
    )

    shared = sorted(got_res["losses"])
    loss_diffs = [s for s in shared if ref_res["losses"].get(s) != got_res["losses"][s]]
    say(f"    step losses  {len(shared) - len(loss_diffs)}/{len(shared)} of run 2's steps equal the reference exactly")
    if loss_diffs:
        more = "..." if len(loss_diffs) > 10 else ""
        problems.append(f"losses differ at steps {loss_diffs[:10]}{more}")

    elapsed = time.monotonic() - t_start
    say()
    if problems:
        for p in problems[:20]:
            say(f"    MISMATCH: {p}")
        if len(problems) > 20:
            say(f"    ... and {len(problems) - 20} more mismatches")
        say(f"FAIL: the resumed run differs from the reference ({elapsed:.0f} s, seed {seed})")
        return 1
    say(
        f"PASS: killed at step {at_step}, resumed from step "
        f"{resumed_from[0] if resumed_from else 'scratch'}, and finished bit-identical to the "
        f"uninterrupted run ({elapsed:.0f} s, seed {seed})"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        for child in _children:
            child.kill()
        sys.exit(130)
