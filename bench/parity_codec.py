"""Reed-Solomon codecs for the memory tier's parity, against memcpy and CRC32C of the same bytes.

For each code (k data + m parity shards) and piece size, one stripe of k random pieces is

- encoded into its m parity pieces, and
- decoded: its first m data pieces lost, rebuilt from the other k - m data and the m parity pieces
  (the worst case: every parity row is used), and checked bit-identical to what was lost,

by each codec that imports: zfec as ``tiercheck.format.parity`` calls it (``encode``/``decode`` on
memoryviews of the pieces), pyeclib's ``isa_l_rs_vand`` and ``liberasurecode_rs_vand`` (its wheel
bundles liberasurecode and ISA-L; ``encode`` of the k pieces as one buffer, ``reconstruct`` of the lost
fragments), and a numpy GF(2^8) table-lookup encoder (a Cauchy matrix, one 256-byte table per
coefficient: the plain baseline, encode only). Throughput is GiB/s of data bytes in (k x piece), the
best of a few rounds; the same bytes are copied (``numpy.copyto`` into a reused buffer) and
checksummed (``tiercheck.format.codec.checksum``, CRC32C) in the same run, and the table gives each
codec's rate over memcpy's.

    python bench/parity_codec.py [--quick] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from harness import GiB, log, machine_info, table, write_json

from tiercheck.format.codec import checksum
from tiercheck.format.parity import Stripes, decode, encode

KiB = 1 << 10
MiB = 1 << 20
CODES = ((2, 2), (4, 2), (8, 2))
PIECES = (256 * KiB, 1 * MiB, 4 * MiB)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "parity_codec.json"
PYECLIB = ("isa_l_rs_vand", "liberasurecode_rs_vand")


def rate(nbytes: int, fn: Callable[[], Any], *, rounds: int, min_s: float) -> float:
    """GiB/s of ``nbytes`` per call of ``fn``: the best round, each round calls until ``min_s`` has passed."""
    best = float("inf")
    for _ in range(rounds):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            spent = time.perf_counter() - t0
            if spent >= min_s:
                break
        best = min(best, spent / calls)
    return nbytes / GiB / best


# -------------------------------------------------------------------------- GF(2^8) by table lookup


def _gf_tables() -> np.ndarray:
    """MUL[a, b] = a x b in GF(2^8) (polynomial 0x11d, as zfec and ISA-L use)."""
    exp, log_ = [0] * 512, [0] * 256
    x = 1
    for i in range(255):
        exp[i], log_[x] = x, i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    for i in range(255, 512):
        exp[i] = exp[i - 255]
    mul = np.zeros((256, 256), dtype=np.uint8)
    for a in range(1, 256):
        for b in range(1, 256):
            mul[a, b] = exp[log_[a] + log_[b]]
    return mul


def _gf_inverse(mul: np.ndarray, a: int) -> int:
    return int(np.nonzero(mul[a] == 1)[0][0])


def table_encoder(k: int, m: int) -> Callable[[Sequence[np.ndarray]], list[np.ndarray]]:
    """Parity rows of a Cauchy matrix (1 / (x_p ^ y_j), x_p = k + p, y_j = j), by 256-byte tables."""
    mul = _gf_tables()
    rows = [[mul[_gf_inverse(mul, (k + p) ^ j)] for j in range(k)] for p in range(m)]

    def run(data: Sequence[np.ndarray]) -> list[np.ndarray]:
        out = []
        for row in rows:
            acc = np.take(row[0], data[0])
            for coef, shard in zip(row[1:], data[1:], strict=True):
                np.bitwise_xor(acc, np.take(coef, shard), out=acc)
            out.append(acc)
        return out

    return run


# ---------------------------------------------------------------------------------------- the run


def measure(
    k: int, m: int, piece: int, *, region: int, rounds: int, min_s: float, rng: np.random.Generator
) -> dict[str, Any]:
    """One (k, m, piece): every codec's encode and decode rate, memcpy's and CRC32C's, and the checks. Each
    call codes ``region`` bytes of data, stripe after stripe, each stripe's pieces bytes of their own (as a
    snapshot of many stripes streams from memory, not from the CPU's caches)."""
    count = max(1, region // (k * piece))
    nbytes = count * k * piece
    whole = rng.integers(0, 256, nbytes, dtype=np.uint8)
    stripes_data = [[whole[(s * k + j) * piece : (s * k + j + 1) * piece] for j in range(k)] for s in range(count)]
    views = [[memoryview(p) for p in data] for data in stripes_data]
    dst = np.empty_like(whole)
    got: dict[str, Any] = {"k": k, "m": m, "piece": piece, "stripes": count, "data_bytes": nbytes, "gib_s": {},
                           "notes": []}  # fmt: skip
    r = got["gib_s"]

    def timed_rate(fn: Callable[[], Any]) -> float:
        return rate(nbytes, fn, rounds=rounds, min_s=min_s)

    r["memcpy"] = timed_rate(lambda: np.copyto(dst, whole))
    r["crc32c"] = timed_rate(lambda: checksum(memoryview(whole)))

    code = Stripes(k + m, m)
    lost, rows = list(range(m)), list(range(m))
    parity = [encode(code, v, rows) for v in views]
    r["zfec encode"] = timed_rate(lambda: [encode(code, v, rows) for v in views])
    have = [
        {j: v[j] for j in range(m, k)} | {k + p: par[p] for p in range(m)} for v, par in zip(views, parity, strict=True)
    ]
    rebuilt = [decode(code, h, lost) for h in have]
    got["zfec_bit_identical"] = all(
        b[j] == d[j].tobytes() for b, d in zip(rebuilt, stripes_data, strict=True) for j in lost
    )
    r["zfec decode"] = timed_rate(lambda: [decode(code, h, lost) for h in have])
    if importable("pyeclib"):
        _pyeclib(k, m, got, stripes_data, timed_rate)
    run_table = table_encoder(k, m)
    r["numpy table encode"] = timed_rate(lambda: [run_table(d) for d in stripes_data])
    got["vs_memcpy"] = {name: v / r["memcpy"] for name, v in r.items()}
    return got


def _pyeclib(k: int, m: int, got: dict[str, Any], stripes_data: list[list[np.ndarray]],
             timed_rate: Callable[[Callable[[], Any]], float]) -> None:  # fmt: skip
    """pyeclib's backends: ``encode`` of each stripe's k pieces as one buffer (as its API takes them),
    ``reconstruct`` of the first m fragments from the others."""
    from pyeclib.ec_iface import ECDriver

    payloads = [b"".join(p.tobytes() for p in data) for data in stripes_data]
    lost = list(range(m))
    for ec_type in PYECLIB:
        try:
            driver = ECDriver(k=k, m=m, ec_type=ec_type)
        except Exception as e:  # a backend the wheel lacks: say so, measure the others
            got["notes"].append(f"pyeclib {ec_type}: not available ({type(e).__name__}: {e})")
            continue
        frags = [driver.encode(p) for p in payloads]
        got["gib_s"][f"{ec_type} encode"] = timed_rate(lambda d=driver: [d.encode(p) for p in payloads])
        back = [driver.reconstruct(f[m:], lost) for f in frags]
        got[f"{ec_type}_bit_identical"] = all(list(b) == list(f[:m]) for b, f in zip(back, frags, strict=True))
        got["gib_s"][f"{ec_type} decode"] = timed_rate(
            lambda d=driver, fs=frags: [d.reconstruct(f[m:], lost) for f in fs]
        )
        got[f"{ec_type}_fragment_bytes"] = len(frags[0][0])


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def render(rows: list[dict[str, Any]]) -> str:
    names = [n for n in rows[0]["gib_s"] if n != "memcpy"]
    for row in rows[1:]:
        names += [n for n in row["gib_s"] if n not in names and n != "memcpy"]
    headers = ["k+m", "piece", "memcpy GiB/s", *names]
    cells = []
    for row in rows:
        ratios = [f"{row['vs_memcpy'][n]:.3f}" if n in row["vs_memcpy"] else "-" for n in names]
        cells.append([f"{row['k']}+{row['m']}", f"{row['piece'] // KiB} KiB", f"{row['gib_s']['memcpy']:.2f}", *ratios])
    return table(headers, cells)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only k=2, m=2 at 256 KiB, short rounds: a smoke run")
    p.add_argument("--region-mib", type=int, default=None, help="data bytes coded per call (default 64, quick 4)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measurement, the best kept (default 5)")
    p.add_argument("--json", nargs="?", const=str(DEFAULT_JSON), metavar="PATH",
                   help=f"write the measurements (default {DEFAULT_JSON.relative_to(DEFAULT_JSON.parents[2])})")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    codes, pieces = ((2, 2),) if args.quick else CODES, (256 * KiB,) if args.quick else PIECES
    rounds = args.rounds or (2 if args.quick else 5)
    min_s = 0.01 if args.quick else 0.1
    region = (args.region_mib or (4 if args.quick else 64)) * MiB
    notes = [] if importable("pyeclib") else ["pyeclib is not importable here: its codecs are not measured"]
    for note in notes:
        print(f"note: {note}")
    rng = np.random.default_rng(68)
    rows = []
    for k, m in codes:
        for piece in pieces:
            log(f"k={k} m={m} piece={piece // KiB} KiB")
            rows.append(measure(k, m, piece, region=region, rounds=rounds, min_s=min_s, rng=rng))
            for note in rows[-1]["notes"]:
                print(f"note: {note}")
    print("encode and decode rates over memcpy's (numpy.copyto of the same k x piece bytes), same run:")
    print(render(rows))
    wrong = [r for r in rows for key, ok in r.items() if key.endswith("_bit_identical") and not ok]
    if wrong:
        print(f"ERROR: a decode gave back other bytes than were lost: {wrong}")
    if args.json:
        versions = {name: _version(name) for name in ("zfec", "pyeclib", "numpy")}
        doc = {"machine": machine_info(), "versions": versions, "rounds": rounds, "min_s": min_s,
               "region_bytes": region, "notes": notes,
               "rows": rows}  # fmt: skip
        log(f"wrote {write_json(args.json, doc)}")
    return 1 if wrong else 0


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
