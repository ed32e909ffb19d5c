"""The limits ``parity_bench.py`` measures in the same run as its jobs: memcpy + CRC32C of a node's bytes,
zfec's encode of a node's share of a save's coding and decode of the busiest lost node's share of a two-node
rebuild (as ``tiering.rebuild_rounds.routes`` routes it), and gloo send/recv, on one rank alone and on every rank
at once. Also the layout both share: 6 nodes, parity 4+2, nodes 0 and 1 lost."""

from __future__ import annotations

import time
from typing import Any

NODES = 6
DATA, PARITY = 4, 2
LOST = {"parity": (0, 1), "replicas": (1,)}


def _best(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _memcpy_crc(nbytes: int) -> float:
    """memcpy of ``nbytes`` into memory written before, then CRC32C of the copy; best of 3 (seconds)."""
    import torch

    from tiercheck.format.codec import checksum

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    return _best(lambda: (dst.copy_(src), checksum(dst.numpy().data)))


def busiest() -> tuple[int, list[Any], int]:
    """The lost node with the most rows to decode in the two-node rebuild (``tiering.rebuild_rounds.routes``:
    each stripe both lack is decoded by one of them), its routes, and the pieces (of ``S / d``) it receives."""
    from tiercheck.format.parity import Stripes
    from tiercheck.tiering.rebuild_rounds import routes

    st, lost = Stripes(DATA + PARITY, PARITY), LOST["parity"]
    plan = routes(st, lost, [i for i in range(NODES) if i not in lost], parity=False)
    rows = {i: sum(len(r.lacking) for r in plan if st.holder(r.stripe, r.decoder) == i) for i in lost}
    node = max(lost, key=lambda i: (rows[i], -i))
    mine = [r for r in plan if st.holder(r.stripe, r.decoder) == node]
    forwarded = sum(1 for r in plan if r not in mine for k in r.lacking if st.holder(r.stripe, k) == node)
    return node, mine, st.d * len(mine) + forwarded


def _zfec(nbytes: int, what: str) -> float:
    """zfec's work, as ``format.parity`` calls it, in the rounds ``tiering.parity`` and ``tiering.rebuild_rounds``
    cut (``chunk_bytes`` of each piece a round): "encode", a node's share of a save's coding (its ``m`` parity
    pieces, each from ``d`` data slices); "decode", the busiest lost node's share of a two-node rebuild before
    the restore (``busiest``: the stripes it decodes, each from ``d`` shards, every piece the stripe lacks in one
    pass; the parity pieces come back after the restore). Best of 2 (seconds)."""
    import numpy as np

    from tiercheck.format.parity import Stripes, decode, encode
    from tiercheck.options import ReplicationOptions
    from tiercheck.tiering.parity import chunk_bytes

    st = Stripes(DATA + PARITY, PARITY)
    piece = -(-nbytes // st.d)
    chunk = chunk_bytes(ReplicationOptions(), st, piece)
    rng = np.random.default_rng(7)  # random bytes, as a state's are: zfec's table lookups go over all of them
    shards = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(st.n)]

    def rounds() -> None:
        for offset in range(0, piece, chunk):
            n = min(chunk, piece - offset)
            if what == "encode":
                for _ in range(st.m):
                    encode(st, [b[:n] for b in shards[: st.d]], [0])
                continue
            for r in busiest()[1]:
                decode(st, {k: shards[k][:n] for k in r.sources}, r.lacking)

    return _best(rounds, 2)


def limits(rank: int, nbytes: int, kind: str) -> dict[str, Any]:
    """On rank 0 alone (the others wait) and on every rank at once: memcpy + CRC32C of ``nbytes``, and
    with parity zfec's encode and decode of a node's share (``_zfec``); gloo send/recv of ``nbytes`` from
    rank 2 to rank 0 (best of 3)."""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {}
    work = [("memcpy_crc", lambda: _memcpy_crc(nbytes))]
    if kind == "parity":
        work += [("encode", lambda: _zfec(nbytes, "encode")), ("decode", lambda: _zfec(nbytes, "decode"))]
    for name, fn in work:
        dist.barrier()
        out[f"{name}_alone_s"] = fn() if rank == 0 else None
        dist.barrier()
        out[f"{name}_together_s"] = fn()
    buf, src = torch.ones(nbytes if rank in (0, 2) else 1, dtype=torch.uint8), 2

    def p2p() -> None:
        dist.barrier()
        if rank == src:
            dist.send(buf, 0)
        elif rank == 0:
            dist.recv(buf, src)
        dist.barrier()

    gloo = _best(p2p)
    return out | {"gloo_s": gloo if rank in (0, 2) else None}
