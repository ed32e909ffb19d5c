"""Peer protection of the memory tier's steps, for ``tiercheck plan --replicas R`` and ``--parity K,M``: what whole
copies and Reed-Solomon parity (``ParityOptions``, ``format.parity``) cost a node in RAM and network per step, and
the node losses each survives.

For a node whose memory-tier snapshot (all its ranks' files of a step) is ``S`` bytes, with ``slots`` slots:

- **copies** (``replicas = r``): RAM ``slots x (1 + r) x S`` (its slots, and ``r`` peers' copies of each step its
  slots hold: a copy lives in its step's directory and goes with it; ``bench/parity_bench.py``); per step it
  sends its files to ``r`` peers and receives ``r`` peers' files, ``r x S`` each way; any ``r`` nodes lost at
  once leave a copy of every node's files.
- **parity** (``k`` data + ``m`` parity, a group of ``n`` nodes, ``d = n - m`` data pieces a stripe: ``k`` where
  the node count is a multiple of ``k + m``, fewer in the group that takes the rest or in a job of fewer nodes):
  RAM ``(slots + m / d) x S`` in the steady state (one protected step's parity), up to ``(slots + 2m / d) x S``
  while the next step encodes (the previous step's parity stays until the new one is committed). Each of its
  ``d`` pieces goes to the ``m`` parity holders of its stripe and it receives ``d`` pieces for each of its ``m``
  parity pieces: ``m x S`` sent and received, as ``m`` copies. A group survives any ``m`` of its nodes lost.

Pure arithmetic over ``format.parity.groups`` (the worst node: the smallest ``d`` of the job's groups).
"""

from __future__ import annotations

import math
from typing import Any

from tiercheck.errors import InvalidArgumentError
from tiercheck.format.parity import groups
from tiercheck.options import ParityOptions


def parse_parity(text: str) -> ParityOptions:
    """``K,M`` (data, parity pieces a stripe) as ``ParityOptions`` (``InvalidArgumentError`` naming ``--parity``)."""
    try:
        k, m = (int(x) for x in text.split(","))
        return ParityOptions(data=k, parity=m)
    except (ValueError, InvalidArgumentError) as e:
        why = str(e) if isinstance(e, InvalidArgumentError) else "two whole numbers"
        raise InvalidArgumentError(f"--parity expects DATA,PARITY (e.g. 4,2), got {text!r}: {why}") from None


def protection(
    *, snapshot_bytes: int, slots: int, nodes: int, replicas: int, parity: ParityOptions | None,
    link_gbps: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Copies (``replicas``; where 0 and ``parity`` is given, as many copies as its losses survived, to compare)
    against parity, per node: RAM held, bytes sent and received per step, losses survived, and with ``link_gbps``
    the seconds a step's sending takes on the node's link."""
    rows: list[dict[str, Any]] = []
    copies = replicas or (parity.parity if parity is not None else 0)
    if copies:
        rows.append({
            "scheme": f"copies (replicas={copies})", "extra_snapshots": float(slots * copies),
            "peak_snapshots": float(slots * copies),
            "sent_bytes": copies * snapshot_bytes, "received_bytes": copies * snapshot_bytes,
            "survives": f"any {copies} node(s) lost",
        })  # fmt: skip
    if parity is not None:
        k, m = parity.data, parity.parity
        sizes = [len(g) for g in groups(nodes, k + m, m)]
        d = min(sizes) - m  # the worst node: the smallest group codes the fewest data pieces a stripe
        rows.append({
            "scheme": f"parity {k}+{m} (groups of {', '.join(str(s) for s in sorted(set(sizes)))} nodes)",
            "extra_snapshots": m / d, "peak_snapshots": 2 * m / d,
            "sent_bytes": m * snapshot_bytes, "received_bytes": m * snapshot_bytes,
            "survives": f"any {m} node(s) lost per group of {k + m}" if nodes >= k + m else f"any {m} node(s) lost",
        })  # fmt: skip
    for row in rows:
        row["ram_bytes"] = math.ceil((slots + row["extra_snapshots"]) * snapshot_bytes)
        row["peak_ram_bytes"] = math.ceil((slots + row["peak_snapshots"]) * snapshot_bytes)
        row["send_s"] = None if link_gbps is None else row["sent_bytes"] / (link_gbps * 1e9 / 8)
    return {
        "snapshot_bytes": snapshot_bytes, "slots": slots, "nodes": nodes, "link_gbps": link_gbps, "rows": rows,
        "assumptions": [
            "a node's snapshot: all its ranks' files of one step in the memory tier",
            "parity's RAM peaks while a step encodes: the previous step's parity stays until the new one is committed",
            "parity per node is at least m / (n - m) of a snapshot for a group of n surviving m losses (survivors "
            "hold all n regions); Reed-Solomon meets it",
        ],
    }  # fmt: skip
