"""Kill a training run at a random moment, restart it, and show the result is bit-identical.

1. Train ``examples/train.py`` uninterrupted, without checkpoints: the reference.
2. Train it again with ``--ckpt-dir`` and tiercheck's memory tier (``--memory``, a private directory
   on the ``/dev/shm`` tmpfs): every step is saved to memory that outlives the process, every
   ``--every``th also to disk. SIGKILL it at a random moment once at least one checkpoint has had
   time to commit (as a crashed process dies: no cleanup, no final save).
3. Show what the kill left in memory and on disk: committed steps, and any partial step without ``COMMIT``.
4. Start the same command again: it restores the newest committed step, from memory, and finishes.
   It says which step, from which tier, and how long its restart took.
5. Restore the same step from the local directory alone (its files' page cache dropped), for comparison.
6. Compare the two final results tensor by tensor with ``torch.equal``: PASS or FAIL.

With ``--no-memory`` (or where there is no ``/dev/shm``), steps 2-4 use the local directory only and
step 5 is left out.

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
import tempfile
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
RESTART_LINE = re.compile(
    r"^restart: step (\d+) restored from (memory|the local directory) in ([\d.]+) ms(?: \(([\d.]+) ms to read it)?"
)
SHM = Path("/dev/shm")

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


def show_disk(ckpt_dir: Path, where: str = "on disk") -> list[int]:
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
            say(f"    {entry.name}/  {size / 2**20:6.2f} MiB {where} (all its files)  {verdict}")
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
    p.add_argument("--no-memory", action="store_true", help="leave tiercheck's memory tier out: disk only")
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


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to drop the cached pages of ``directory``'s files (``posix_fadvise``), so the
    restore that reads them next reads the disk, as after a reboot; only these files, not the machine's."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # a dirty page is not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def kill_run1(args: argparse.Namespace, run_args: list[str], rng: random.Random, kill_after: int) -> int | None:
    """Start run 1 and SIGKILL it a random part of a checkpoint interval after step ``kill_after``;
    return its last printed step (None: it ended on its own)."""
    run1 = Child("run 1", run_args)
    kill_fraction = rng.random()
    delay = 0.0
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
        return None
    say(f"==> KILLED run 1 with SIGKILL {delay * 1e3:.0f} ms after step {kill_after}; its last printed step was {at_step}")
    return at_step


def show_after_kill(ckpt_dir: Path, memory: Path | None, problems: list[str]) -> int | None:
    """Print what the kill left in memory and on disk; return the newest committed step (None: none)."""
    newest: list[int] = []
    if memory is not None:
        # one directory per node-local directory (named by a hash of its path): here, one
        for tier in sorted(d for d in memory.iterdir() if d.is_dir()) or [memory]:
            say(f"    in memory ({_shown(tier)}):")
            newest += show_disk(tier, where="in memory")
        say(f"    on disk ({_shown(ckpt_dir)}):")
    committed = show_disk(ckpt_dir)
    newest += committed
    if committed:
        try:
            latest = tiercheck.load(ckpt_dir)
            say(f"    tiercheck.load(): the newest committed step on disk holds progress {latest['progress']}")
        except Exception as exc:  # a demo: report any failure and carry on with the others
            problems.append(f"tiercheck.load({ckpt_dir}) raised {exc!r}")
            say(f"    tiercheck.load() FAILED: {exc!r}")
    if not newest:
        say("    nothing committed yet: run 2 will start from scratch (still must match)")
    return max(newest, default=None)


def compare_with_disk(common: list[str], ckpt_dir: Path, memory: re.Match[str]) -> float | None:
    """Restore ``step`` from the local directory alone, in a fresh process, its files' page cache
    dropped; print both restart times; return the local one in ms (None: it failed)."""
    step, memory_ms, read_ms = int(memory.group(1)), float(memory.group(3)), float(memory.group(4) or "nan")
    drop_page_cache(ckpt_dir)
    args = [*(a for a in common if not a.startswith("--steps=")), f"--steps={step + 1}"]
    probe = Child("disk restore", [*args, f"--ckpt-dir={_shown(ckpt_dir)}", f"--restore-step={step}", "--keep-last=0"])
    if probe.finish() != 0 or not (m := [x for line in probe.lines if (x := RESTART_LINE.match(line))]):
        say("    the restore from the local directory failed")
        return None
    disk_ms = float(m[0].group(3))
    size = sum(f.stat().st_size for f in (ckpt_dir / f"step-{step:08d}").rglob("*") if f.is_file())
    say(f"    restart of step {step}, the Checkpointer's start and its restore() in a fresh process:")
    say(f"      from memory              {memory_ms:7.1f} ms  ({read_ms:.1f} ms to read it; persisted to disk beside training)")
    say(f"      from the local directory {disk_ms:7.1f} ms  (its files' page cache dropped first)")
    say(
        f"    the restart from memory took {memory_ms / disk_ms:.2f}x the restart from the local directory, end to "
        f"end; at {size / 2**20:.1f} MiB, fixed costs dominate both (bench/memory_bench.py measures more)"
    )
    return disk_ms


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    memory: Path | None = None
    if not args.no_memory and SHM.is_dir():
        memory = Path(tempfile.mkdtemp(prefix="tiercheck-demo-", dir=SHM))
    try:
        return run_demo(args, memory)
    finally:
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)  # the memory tier outlives processes: RAM until removed


def run_demo(args: argparse.Namespace, memory: Path | None) -> int:
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
    ckpt_args = [f"--ckpt-dir={_shown(ckpt_dir)}"]
    if memory is not None:  # keep every step on disk: step 5 restores the step run 2 restored from memory
        ckpt_args += [f"--memory={memory}", "--keep-last=0"]
    # Kill once step `kill_after` has printed, plus a random part of one checkpoint interval,
    # so the kill lands anywhere: mid-step, mid-save, between saves. By then the save of step
    # `kill_after - every` (at least) has had a whole interval to commit.
    kill_after = rng.randint(2 * args.every, args.steps * 3 // 4)
    n = 6 if memory is not None else 4
    say(f"tiercheck kill-and-resume demo (seed {seed}; replay with --seed {seed})")
    say(f"work directory: {workdir}" + (f"; memory tier: {memory}" if memory is not None else ""))

    banner(f"1/{n}  reference run: no checkpoints, never interrupted")
    ref = Child("reference", [*common, f"--out={_shown(ref_out)}"])
    if (rc := ref.finish()) != 0:
        say(f"reference run failed with exit code {rc}")
        return 2

    where = (f"every step to memory, every {args.every} steps also to {_shown(ckpt_dir)}" if memory is not None
             else f"every {args.every} steps in {_shown(ckpt_dir)}")  # fmt: skip
    banner(f"2/{n}  run 1: checkpoints {where}; SIGKILL soon after step {kill_after}")
    at_step = kill_run1(args, [*common, *ckpt_args], rng, kill_after)
    if at_step is None:
        return 2

    banner(f"3/{n}  {'in memory and ' if memory is not None else ''}on disk after the kill")
    problems: list[str] = []
    newest = show_after_kill(ckpt_dir, memory, problems)

    banner(f"4/{n}  run 2: the same command again; it restores and finishes")
    run2 = Child("run 2, resumed", [*common, *ckpt_args, f"--out={_shown(resumed_out)}"])
    if (rc := run2.finish()) != 0:
        say(f"run 2 failed with exit code {rc}")
        return 2
    resumed_from = run2.matches(RESUMED_LINE)
    restart = [m for line in run2.lines if (m := RESTART_LINE.match(line))]
    if memory is not None and newest is not None:
        banner(f"5/{n}  for comparison: the same step restored from the local directory alone")
        if not restart or restart[0].group(2) != "memory":
            problems.append(f"run 2 did not restart from memory: {[m.group(0) for m in restart]}")
        elif compare_with_disk(common, ckpt_dir, restart[0]) is None:
            problems.append("the same step could not be restored from the local directory")

    banner("result" if memory is None else f"{n}/{n}  result")
    if newest is not None:
        if resumed_from != [newest]:
            problems.append(
                f"run 2 resumed from {resumed_from or 'nothing'}, but the newest committed step was {newest}"
            )
        else:
            tier = f" (from {restart[0].group(2)}, in {restart[0].group(3)} ms)" if restart else ""
            say(
                f"    run 2 resumed from step {resumed_from[0]}{tier}, the newest committed step, "
                f"and ran steps {resumed_from[0] + 1}..{args.steps - 1}"
            )
    came = f" (from {restart[0].group(2)})" if restart else ""
    return verdict(ref_out, resumed_out, problems, f"killed at step {at_step}, resumed from step "
                   f"{resumed_from[0] if resumed_from else 'scratch'}{came}", seed, t_start)  # fmt: skip


def verdict(ref_out: Path, resumed_out: Path, problems: list[str], story: str, seed: int, t_start: float) -> int:
    """Compare the resumed run's final results with the reference's: PASS (0) or FAIL (1)."""
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
    say(f"PASS: {story}, and finished bit-identical to the uninterrupted run ({elapsed:.0f} s, seed {seed})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        for child in _children:
            child.kill()
        sys.exit(130)
