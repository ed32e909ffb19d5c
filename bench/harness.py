"""The shared harness of the benchmarks in bench/: every scenario script is a thin layer on it.

What lives here, and nothing else: machine info and the machine's limits measured in the run
(memcpy, fsync'd sequential write, cold sequential read), conditions before a timed phase (page
cache dropped, hypervisor steal settled) and the noise they leave (foreign CPU, steal, spread of
repeats), timing and memory readings (RSS, peak RSS), running a worker function in a fresh
subprocess, and output (markdown tables, min/median/max of ratios over repeats, JSON).

No torch import at module level: a parent that only orchestrates workers stays small.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# Scenario scripts import tiercheck and tests/ helpers from the checkout, not an installed copy.
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class MethodTimers:
    """Seconds spent in methods wrapped with ``wrap`` since the last ``take``, in this process, by
    name (a benchmark timing a library's phases as it ships, e.g. dist_bench's restore by phase)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {}
        return out

def when_done(inner: Future[Any], then: Callable[[], None] = lambda: None) -> Future[float]:
    """A future of the perf_counter() time ``inner`` completed (after ``then()``), or its failure."""
    out: Future[float] = Future()

    def cb(f: Future[Any]) -> None:
        try:
            f.result()
            then()
            out.set_result(time.perf_counter())
        except BaseException as exc:
            out.set_exception(exc)

    inner.add_done_callback(cb)
    return out


def dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    """DCP's state dict of a model and its optimizer, as DCP users save it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}



# ------------------------------------------------------------------------------------------
# Machine info and memory
# ------------------------------------------------------------------------------------------


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read()
    return ""


def machine_info(path: Path | str = ".") -> dict[str, Any]:
    """CPUs, RAM, versions and the filesystem ``path`` lives on."""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")),
        "unknown",
    )
    mem = next(
        (int(ln.split()[1]) * 1024 for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal:")), 0
    )
    target, best, fs = str(Path(path).resolve()), "", "unknown"
    for line in _read("/proc/mounts").splitlines():  # the longest mount point above ``path``
        dev, mnt, kind = line.split()[:3]
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fs = mnt, f"{kind} ({dev} on {mnt})"
    import torch

    try:
        import tiercheck

        tc = getattr(tiercheck, "__version__", "unknown")
    except Exception as exc:
        tc = f"not importable: {type(exc).__name__}: {exc}"
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "ram_bytes": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "tiercheck": tc,
        "fs": fs,
        "root": os.geteuid() == 0,
    }


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu_count']} vCPUs ({m['cpu_model']}), {m['ram_bytes'] / GiB:.1f} GiB RAM, torch {m['torch']} "
        f"({m['torch_threads']} threads), Python {m['python']}, tiercheck {m['tiercheck']}; {m['fs']}"
    )


def _status_kib(name: str) -> int:
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """Peak RSS since the process started or since the last ``reset_hwm()``."""
    return _status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------
# Files: fsync and the page cache
# ------------------------------------------------------------------------------------------


def fsync_path(path: Path | str) -> None:
    """fsync a file, or a directory so the entries created in it are durable too."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def fsync_tree(root: Path | str) -> None:
    """fsync every file under ``root`` and every directory, bottom up."""
    for top, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(top, name))
        fsync_path(top)


def tree_bytes(root: Path | str) -> int:
    """Bytes of the files under ``root`` (a file removed meanwhile counts 0)."""
    total = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(top, name)).st_size
    return total


def drop_caches(enabled: bool = True, paths: Sequence[Path | str] = ()) -> str:
    """Flush dirty pages and make the next reads cold. Returns how: "drop_caches" (root: every
    cached page of the machine), "fadvise" (not root: posix_fadvise(DONTNEED) on the files under
    ``paths`` only, which the kernel may ignore for pages in use), or "" (nothing dropped)."""
    os.sync()
    if not enabled:
        return ""
    if os.geteuid() == 0:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
            return "drop_caches"
    files = [os.path.join(t, n) for p in paths for t, _d, ns in os.walk(p) for n in ns]
    files += [str(p) for p in paths if os.path.isfile(p)]
    for name in files:
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise" if files else ""


# ------------------------------------------------------------------------------------------
# CPU: steal, settling, foreign load
# ------------------------------------------------------------------------------------------


def cpu_times() -> dict[str, float]:
    """Whole-machine CPU seconds by state, from /proc/stat."""
    hz = os.sysconf("SC_CLK_TCK")
    v = [int(x) for x in _read("/proc/stat").split("\n", 1)[0].split()[1:9]]
    return {
        "user": (v[0] + v[1]) / hz,
        "system": (v[2] + v[5] + v[6]) / hz,
        "idle": v[3] / hz,
        "iowait": v[4] / hz,
        "steal": v[7] / hz,
    }


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def busy_s(delta: dict[str, float]) -> float:
    return delta["user"] + delta["system"]


def steal_share(delta: dict[str, float]) -> float:
    """Share of all vCPU time the hypervisor gave to another guest."""
    total = sum(delta.values())
    return delta["steal"] / total if total > 0 else 0.0


def settle(max_wait_s: float, threshold: float = 0.05, window_s: float = 0.5) -> float:
    """Wait (up to ``max_wait_s``) until a ``window_s`` window shows less than ``threshold`` steal.

    On this shared VM, gigabytes of fsync'd writes (and deletes on the discard-mounted disk) are
    followed by seconds of heavy steal: whatever phase came next would run 2-3x slower and be
    charged for the previous phase's I/O. Returns the seconds waited.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        a = cpu_times()
        time.sleep(window_s)
        if steal_share(cpu_delta(a, cpu_times())) < threshold:
            break
    return time.perf_counter() - t0


def prepare(drop: bool, settle_max_s: float, paths: Sequence[Path | str] = ()) -> str:
    """Before a timed phase: drop the page cache (see ``drop_caches``), then let steal settle."""
    how = drop_caches(drop, paths)
    settle(settle_max_s)
    return how


def _proc_ticks() -> dict[int, tuple[int, str]]:
    """pid: (utime+stime+cutime+cstime, name) of every user-space process."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        fields = rest.split()
        if entry == "2" or fields[1] == "2":  # kernel threads
            continue
        out[int(entry)] = (sum(int(x) for x in fields[11:15]), head.split("(", 1)[-1])
    return out


def _tree_pids(root: int, ppids: dict[int, int]) -> set[int]:
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(c for c, p in ppids.items() if p == pid)
    return out


def _ppids() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[int(entry)] = int(_read(f"/proc/{entry}/stat").rsplit(")", 1)[1].split()[1])
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants (a server, a worker tree)."""
    hz, ticks = os.sysconf("SC_CLK_TCK"), _proc_ticks()
    return sum(ticks.get(p, (0, ""))[0] for p in _tree_pids(root, _ppids())) / hz


class ForeignCpu:
    """CPU used by processes outside this benchmark's process tree while a phase ran.

    Per process: the growth of utime+stime+cutime+cstime; a child that exits adds its lifetime to
    its parent's cutime, so the ticks it had at the start are subtracted again. The sum is capped by
    the machine's busy ticks minus our own. ``stop()`` also names the busiest foreign processes.
    """

    def __init__(self) -> None:
        self._hz, self._me = os.sysconf("SC_CLK_TCK"), os.getpid()
        self._start, self._cpu0, self._t0 = _proc_ticks(), cpu_times(), time.monotonic()

    def stop(self) -> dict[str, Any]:
        end, cpu = _proc_ticks(), cpu_delta(self._cpu0, cpu_times())
        wall, ncpu = time.monotonic() - self._t0, os.cpu_count() or 1
        ours = _tree_pids(self._me, _ppids())
        mine = end.get(self._me, (0, ""))[0] - self._start.get(self._me, (0, ""))[0]
        grown = {p: t - self._start.get(p, (0, ""))[0] for p, (t, _n) in end.items() if p not in ours}
        exited = sum(t for p, (t, _n) in self._start.items() if p not in end and p not in ours)
        busy = busy_s(cpu) * self._hz
        foreign = min(max(0, sum(grown.values()) - exited), max(0, busy - mine)) / self._hz
        top = sorted(((t / self._hz, end[p][1]) for p, t in grown.items() if t > 0), reverse=True)[:3]
        return {
            "wall_s": wall,
            "foreign_cpu_s": foreign,
            "foreign_cpu_share": foreign / (wall * ncpu) if wall > 0 else 0.0,
            "machine_busy_share": busy / self._hz / (wall * ncpu) if wall > 0 else 0.0,
            "steal_share": steal_share(cpu),
            "top_foreign": [f"{name} {s:.1f}s" for s, name in top],
        }


def loadavg() -> str:
    return " ".join(_read("/proc/loadavg").split()[:3])


def noise_warnings(
    label: str, load: dict[str, Any] | None = None, repeats: Sequence[float] = (), max_share: float = 0.05
) -> list[str]:
    """Lines warning that a phase's numbers are inflated or unstable: foreign CPU above
    ``max_share``, steal above it, or repeats spread by more than 20% around their median."""
    out = []
    if load and load.get("foreign_cpu_share", 0) > max_share:
        out.append(
            f"WARNING {label}: other processes used {100 * load['foreign_cpu_share']:.0f}% of the CPUs "
            f"({', '.join(load.get('top_foreign', []))}); timings are inflated"
        )
    if load and load.get("steal_share", 0) > max_share:
        out.append(f"NOTE {label}: the hypervisor stole {100 * load['steal_share']:.0f}% of vCPU time")
    finite = [x for x in repeats if x is not None and math.isfinite(x)]
    if len(finite) > 1 and statistics.median(finite) > 0:
        spread = (max(finite) - min(finite)) / statistics.median(finite)
        if spread > 0.2:
            out.append(f"NOTE {label}: repeats spread {100 * spread:.0f}% around their median; compare with care")
    return out


# ------------------------------------------------------------------------------------------
# Machine limits
# ------------------------------------------------------------------------------------------


def measure_memcpy(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """GiB/s of ``dst.copy_(src)`` (best of ``repeats``): into a preallocated, faulted buffer with
    1 and with torch's threads ("reused_Nt"), and into fresh memory that pays first-touch faults."""
    import torch

    default = torch.get_num_threads()
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out: dict[str, float] = {}

    def best(copy: Callable[[], Any]) -> float:
        return nbytes / GiB / min(timed(copy)[0] for _ in range(repeats))

    try:
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            out[f"reused_{threads}t_gib_s"] = best(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(default)
    dst = None
    out["fresh_gib_s"] = best(lambda: torch.empty_like(src).copy_(src))
    return out


def measure_disk_write(directory: Path | str, nbytes: int, block: int = 64 * MiB, keep: bool = False) -> dict[str, Any]:
    """Raw fsync'd sequential write: ``os.write`` of ``block``-sized pieces, ``fsync``, directory
    ``fsync``: the floor of "time until durable" for the same bytes in the same directory. Each block
    gets a distinct header so nothing below can deduplicate. With ``keep`` the file stays (its path
    is returned) for ``measure_cold_read``."""
    buf = bytearray(os.urandom(block))
    view = memoryview(buf)
    path = Path(directory) / "raw-write.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            n = min(block, nbytes - written)
            buf[:8] = written.to_bytes(8, "little")
            off = 0
            while off < n:
                off += os.write(fd, view[off:n])
            written += n
        t_write = time.perf_counter() - t0
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    total = time.perf_counter() - t0
    if not keep:
        path.unlink()
    return {"bytes": nbytes, "write_s": t_write, "durable_s": total, "gib_s": nbytes / GiB / total, "path": str(path)}


def measure_cold_read(
    files: Sequence[Path | str], drop: bool = True, block: int = 64 * MiB, *, new_memory: bool = False
) -> dict[str, Any]:
    """Sequential read of ``files`` after dropping their pages (see ``drop_caches``; "cache" says
    how, "" meaning the read may be warm): into one reused buffer, or with ``new_memory`` into one
    new anonymous mapping as large as the files, whose every page faults on first touch as it does
    for any restore that lands a state in memory the process did not hold (a restore that keeps
    the live state until every byte is verified must)."""
    how = drop_caches(drop, files)
    size = sum(os.path.getsize(f) for f in files)
    dest = mmap.mmap(-1, max(size, 1)) if new_memory else None
    buf = memoryview(dest) if dest is not None else memoryview(bytearray(block))
    total, t0 = 0, time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf[total : total + block] if dest is not None else buf):
                total += n
    s = time.perf_counter() - t0
    buf.release()
    if dest is not None:
        dest.close()
    return {"bytes": total, "s": s, "gib_s": total / GiB / s if s > 0 else math.inf, "cache": how}


# ------------------------------------------------------------------------------------------
# Statistics and output
# ------------------------------------------------------------------------------------------


def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b != 0 and math.isfinite(a) and math.isfinite(b) else None


def spread(xs: Sequence[float | None]) -> dict[str, float] | None:
    """min / median / max of the values that exist (a ratio over ``--repeat`` runs)."""
    vals = sorted(x for x in xs if x is not None and math.isfinite(x))
    return {"min": vals[0], "median": statistics.median(vals), "max": vals[-1], "n": len(vals)} if vals else None


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{spec}}{suffix}"


def fmt_spread(s: dict[str, float] | None, spec: str = ".2f") -> str:
    """The median and (min-max), or the one value when there was one run."""
    if not s:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:{spec}}"
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: bool = True) -> str:
    """A markdown table; cells are str() of the values, columns after the first right-aligned."""
    sep = ["---"] + [("---:" if right else "---")] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | str, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))
    return path


@contextlib.contextmanager
def scratch_dir(parent: str | Path | None, prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh directory under ``parent`` (default bench/results/), removed at the end unless ``keep``."""
    base = Path(parent).resolve() if parent else RESULTS_DIR
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def common_args(p: argparse.ArgumentParser, *, settle_s: float = 10.0, json_path: bool = True) -> None:
    """The options every benchmark takes the same way."""
    p.add_argument("--quick", action="store_true", help="small state, few repeats: a smoke run")
    p.add_argument("--dir", help="parent of the scratch directory (removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache (root only anyway)")
    p.add_argument(
        "--settle-max-s", type=float, default=settle_s, help="wait up to this long for steal < 5%% before a timed phase"
    )
    if json_path:
        p.add_argument("--json", metavar="PATH", help="write the raw measurements to PATH")


def init_one_rank() -> None:
    """A gloo process group of world size 1 on a free loopback port (what DCP's process executor
    and the framework plugins need), with the launcher variables DeepSpeed's writers read."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")
    dist.init_process_group("gloo")


# ------------------------------------------------------------------------------------------
# Workers: one function in a fresh process
# ------------------------------------------------------------------------------------------


def run_worker(script: Path | str, func: str, kwargs: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run ``func(**kwargs)`` from ``script`` in a fresh Python process and return its dict result,
    with "wall_s" and "foreign_load" added, or {"error", "traceback"} when it failed. The worker's
    stdout goes to our stderr, so tables stay alone on stdout."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    cmd = [sys.executable, __file__, "--worker", str(script), func, json.dumps(kwargs), str(out)]
    foreign, t0 = ForeignCpu(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    wall, load = time.perf_counter() - t0, foreign.stop()
    try:
        res: dict[str, Any] = json.loads(out.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        res = {}
    out.unlink(missing_ok=True)
    if rc != 0 and "error" not in res:
        res["error"] = f"worker exited with {rc}"
    return {**res, "wall_s": wall, "foreign_load": load}


def _worker_main(script: str, func: str, kwargs: str, out: str) -> int:
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    try:
        result = getattr(module, func)(**json.loads(kwargs))
    except BaseException as exc:
        write_json(out, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    write_json(out, result)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.exit(_worker_main(*sys.argv[2:6]))
