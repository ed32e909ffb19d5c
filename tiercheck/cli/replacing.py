"""A replaced node's restart, for ``tiercheck plan --link-gbps``: how long the node's restore from its peers'
memory takes at a model's scale and a link's speed.

Pure arithmetic (stdlib only). A node replaced after a loss has an empty memory tier: its ranks receive every
byte of their state over the network, from the peers holding its files and the data-parallel replicas
holding the rest (the restore's phases: ``restore.report.PHASES``). The time is

    ``fixed_s + bytes_in / link_bytes_per_s · transfer_ratio``

with ``bytes_in`` what the node's ranks hold (``bytes_in``), ``link_bytes_per_s`` the node's link, and two
figures of tiercheck's own restore: ``transfer_ratio``, its transfer's seconds over a plain send/recv of the
same bytes on the same link, and ``fixed_s``, its seconds outside the transfer (agree, plan, verify, place).
Both are measured by ``bench/replace_node.py`` (``bench/results/replace_node.json``) where that file is found,
else stated (``STATED``); the result says which.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiercheck.errors import InvalidArgumentError

RESULTS = Path("bench") / "results" / "replace_node.json"


@dataclass(frozen=True)
class ReplaceFigures:
    """tiercheck's restore of a replaced node against its link: ``transfer_ratio`` (its transfer over a plain
    send/recv of the same bytes) and ``fixed_s`` (its seconds in agree, plan, verify and place); ``source``:
    "stated", or the file they were measured in."""

    transfer_ratio: float
    fixed_s: float
    source: str


#: STATED, not measured: the transfer at 1.5x a plain send/recv of its bytes, and 1 s outside it (the
#: simulation of bench/scale_sim.py --replace plans a replaced node's restore in well under that at 131,072 ranks).
STATED = ReplaceFigures(1.5, 1.0, "stated")


def default_figures(cwd: Path | None = None) -> ReplaceFigures:
    """The figures measured in ``bench/results/replace_node.json`` under ``cwd`` (default: the current directory)
    or in the source checkout tiercheck runs from, the first found; else ``STATED``."""
    for root in (cwd or Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / RESULTS).is_file():
            return load_figures(root / RESULTS)
    return STATED


def load_figures(path: Path) -> ReplaceFigures:
    """The figures of ``bench/replace_node.py``'s JSON at ``path``: of its jobs, the largest transfer ratio
    and fixed seconds of a replaced node (the slower job's)."""
    try:
        doc = json.loads(path.read_text())
        summaries = [j["summary"] for j in doc["jobs"] if isinstance(j, dict) and j.get("summary")]
        ratio = max(float(s["transfer_vs_gloo"]) for s in summaries)
        fixed = max(float(s["fixed_s"]) for s in summaries)
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{type(e).__name__}: {e}"
        raise InvalidArgumentError(f"{path}: not bench/replace_node.py's measurements ({why})") from None
    if not (math.isfinite(ratio) and ratio > 0 and math.isfinite(fixed) and fixed >= 0):
        raise InvalidArgumentError(f"{path}: transfer_vs_gloo must be above 0 and fixed_s 0 or more")
    return ReplaceFigures(ratio, fixed, str(path))


def bytes_in(*, weights: int, optimizer: int, tp: int, pp: int, dp: int, ranks_on_node: int) -> int:
    """The distinct bytes a node's ranks hold of the state, all received by a replaced node (once a node: its
    ranks share what they all need). Ranks in Megatron's order (TP innermost, a node within one pipeline
    stage): the node holds ``min(ranks_on_node, tp)`` (TP, PP) slices of the weights, replicated over DP, and
    each rank its share of the optimizer's state, split over DP (ZeRO-1, a distributed optimizer); at most the
    weights and optimizer state in all."""
    held = min(ranks_on_node, tp) * -(-weights // (tp * pp)) + ranks_on_node * -(-optimizer // (tp * pp * dp))
    return min(held, weights + optimizer)


def replace_node(*, nbytes: int, link_gbps: float, figures: ReplaceFigures) -> dict[str, Any]:
    """The restart of a replaced node receiving ``nbytes`` over a link of ``link_gbps`` gigabits per second."""
    if not (math.isfinite(link_gbps) and link_gbps > 0):
        raise InvalidArgumentError(f"--link-gbps must be a positive number, not {link_gbps}")
    link = link_gbps * 1e9 / 8
    transfer = nbytes / link * figures.transfer_ratio
    return {
        "bytes_in": nbytes,
        "link_gbps": link_gbps,
        "link_bytes_per_s": link,
        "transfer_s": transfer,
        "fixed_s": figures.fixed_s,
        "replace_s": transfer + figures.fixed_s,
        "figures": asdict(figures),
        "assumptions": [
            "the replaced node receives all its ranks hold over its link, once a node: their slices of the weights "
            "(replicated over DP; TP innermost in the rank order) and their shares of the optimizer state (split "
            "over DP)",
            f"transfer = bytes over the link's {link_gbps:g} Gb/s x {figures.transfer_ratio:.2f} (tiercheck's "
            f"transfer over a plain send/recv of the same bytes, {figures.source})",
            f"plus {figures.fixed_s:.3f} s outside the transfer: agree, plan, verify, place ({figures.source})",
            "the copies the node held of its peers are made again in the background, not on the restart's path",
        ],
    }
